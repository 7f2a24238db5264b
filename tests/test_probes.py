"""The one request value (Probes): what its engine calls derive from it. No engine."""

from __future__ import annotations

import pytest

from salience.core.engine.requests import FeatureRequest, Probes, ResidualRequest
from salience.core.probes.calibration import VIEW_NAMES, ReadoutView
from salience.core.probes.steering import Intervention, Op

STEER = Intervention(direction="beta", layers=(2,), op=Op.ADD, value=1.0, generated=True)
ASKED = Probes(
    readout_ranges=[(0, 40)],
    readout_view=ReadoutView.TOKEN,
    steer=[STEER],
    residual=ResidualRequest(layers=(1,), ranges=((5, 50),)),
    features=FeatureRequest(sae=None, k=4, ranges=((0, 8), (30, 60))),
)


def test_a_probes_value_is_frozen_and_holds_tuples() -> None:
    assert ASKED.readout_ranges == ((0, 40),) and ASKED.steer == (STEER,)
    with pytest.raises(AttributeError):
        ASKED.steer = ()  # type: ignore[misc]


def test_clipped_ends_every_range_at_the_end() -> None:
    clipped = ASKED.clipped(32)
    assert clipped.readout_ranges == ((0, 32),)
    assert clipped.residual.ranges == ((5, 32),)
    assert clipped.features.ranges == ((0, 8), (30, 32))
    assert clipped.steer == ASKED.steer and clipped.readout_view is ReadoutView.TOKEN


def test_the_last_tokens_pass_reads_one_position_as_read() -> None:
    last = ASKED.at(39)
    assert last.readout_ranges == ((39, 40),) and last.readout_view is ReadoutView.RAW
    assert last.residual.ranges == ((39, 40),) and last.features.ranges == ((39, 40),)
    assert last.steer == () and last.monitors == ()  # the generation's hold steers it; monitors ran
    assert Probes(residual=ASKED.residual).at(7).readout_ranges == ()


def test_every_view_has_a_wire_name() -> None:
    assert {ReadoutView.named(name) for name in VIEW_NAMES} == set(ReadoutView)
