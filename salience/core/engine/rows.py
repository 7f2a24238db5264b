"""Per-position arrays a request asks for beside its readouts: raw residual rows and SAE features.

Both are captured in the worker as readouts are and travel the same way (readouts.py), each under
a hub key of its own: the request's key plus the field they fill on its events. A `RowPlan` is one
such ask, checked: the worker's tag, the ranges, the shape of a position's rows, and how a row is
handed to the client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from salience.core.engine.requests import FeatureRequest, ResidualRequest, covers
from salience.core.features.served import ServedSAE, pick_sae
from salience.core.probes.readout_worker import FEATURE_TAG, RESIDUAL_TAG
from salience.core.probes.readouts import READ_TO_END, check_ranges
from salience.core.probes.steering import merge_ranges
from salience.errors import InvalidArgument, under

if TYPE_CHECKING:
    from salience.core.probes.readouts import ReadoutHub

__all__ = ["RowPlan", "feature_plan", "layer_names", "residual_plan", "watched_features"]


@dataclass(frozen=True)
class RowPlan:
    field: str  # the TokenEvent / ScoredToken attribute the rows fill: "residual" or "features"
    tag: str  # the worker's extra_args key
    ranges: list[list[int]]  # absolute positions, [start, end)
    args: list  # the tag's fields after [key, ranges]
    layers: int  # rows per position
    width: int  # values per row
    present: Callable[[np.ndarray], Any] | None = None  # a position's [layers, width] block as handed out
    held: int = 0  # residual rows the request may hold at once (row_budget.py); 0 for features

    def key(self, request_key: str) -> str:
        return f"{request_key}#{self.field}"

    def tag_value(self, request_key: str) -> list:
        return [self.key(request_key), self.ranges, *self.args]

    async def take(self, hub: ReadoutHub, request_key: str, positions: Iterable[int]) -> dict[int, Any]:
        """The rows captured at those of `positions` this plan covers, as handed out."""
        wanted = [p for p in positions if covers(self.ranges, p)]
        taken = await hub.take(self.key(request_key), wanted) if wanted else {}
        return taken if self.present is None else {p: self.present(r) for p, r in taken.items()}

    def at(self, position: int) -> RowPlan:
        """The same ask at one position (a generation's last token, read by a pass of its own)."""
        return dataclasses.replace(self, ranges=[[position, position + 1]])


def layer_names(layers: Sequence[int]) -> str:
    """The layers by name, a run of three or more as `first..last`: `0, 2, 3` or `0..29`."""
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def residual_plan(
    residual: ResidualRequest, end: int, *, read: Sequence[int], slots: Sequence[int], hidden: int, limit: int
) -> RowPlan:
    """Residual rows checked against the layers `read` at the asked point (whose capture slots
    are `slots`, in the same order) and the rows one request may ask for (`limit`), with `end`
    the first position the request cannot reach."""
    layers = residual.layers
    if not layers or len(set(layers)) != len(layers):
        raise InvalidArgument("residual.layers must name one or more distinct layers", field="residual.layers")
    unknown = [layer for layer in layers if layer not in read]
    if unknown:
        raise InvalidArgument(
            f"residual layer {unknown[0]!r} is not read; residual rows come from the read layers {layer_names(read)}",
            field="residual.layers",
        )
    ranges = _ranges("residual", residual.ranges)
    positions = sum(max(0, min(e, end) - s) for s, e in merge_ranges([(s, e) for s, e in ranges]))
    if positions * len(layers) > limit:
        raise InvalidArgument(
            f"residual asks for {positions} positions x {len(layers)} layers; at most {limit} "
            "rows per request (--max-residual-rows): ask in several requests, or for fewer layers",
            field="residual",
        )
    picked = [slots[list(read).index(layer)] for layer in layers]
    return RowPlan("residual", RESIDUAL_TAG, ranges, [picked], len(layers), hidden, held=positions * len(layers))


def feature_plan(features: FeatureRequest, saes: Sequence[ServedSAE]) -> RowPlan:
    """An SAE's top features checked against the served SAEs."""
    with under("features.sae"):
        sae = pick_sae(saes, features.sae, "features")
    k = features.k
    if type(k) is not int or not 1 <= k <= sae.top:
        raise InvalidArgument(
            f"features.k must be an integer in 1..{sae.top} for SAE {sae.name!r}, got {k!r}", field="features.k"
        )
    ranges = _ranges("features", features.ranges)
    return RowPlan("features", FEATURE_TAG, ranges, [sae.slot, k], 1, 2 * k, present_features)


def watched_features(
    features: FeatureRequest | None, sae: ServedSAE, prompt_len: int
) -> tuple[FeatureRequest, tuple[int, list[list[int]]]]:
    """What a request with feature monitors reads: the watched SAE's `top` features on every
    generated token beside the client's own ask; and what the client sees of them (its k and
    ranges: Generation trims to them)."""
    if features is not None and (features.sae or sae.name) != sae.name:
        raise InvalidArgument(
            f"features and feature monitors name different SAEs; one request reads one ({sae.name!r})", field="features"
        )
    asked = features.ranges if features is not None else ()
    watched = FeatureRequest(sae=sae.name, k=sae.top, ranges=(*asked, (prompt_len, READ_TO_END)))
    if features is None:
        return watched, (0, [])
    with under("features.ranges"):
        return watched, (features.k, check_ranges(asked))


def present_features(block: np.ndarray) -> tuple[tuple[int, float], ...]:
    """A position's [1, 2k] block (k ids as floats, then their activations, largest first) as its
    active features."""
    k = block.shape[1] // 2
    ids, values = block[0, :k], block[0, k:]
    return tuple((int(i), float(v)) for i, v in zip(ids, values, strict=True) if v > 0)


def _ranges(name: str, ranges: Sequence[tuple[int, int]]) -> list[list[int]]:
    with under(f"{name}.ranges"):
        checked = check_ranges(ranges)
    if not checked:
        raise InvalidArgument(f"{name}.ranges names no positions", field=f"{name}.ranges")
    return checked
