"""The default concept set ships with the package and serves the default model as it is; any
other model, or an edited spec, gets a set built once, and the log says why. A build that another
process is running makes a start wait, saying so."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from salience.core.models.atomic import build_folder_once
from salience.core.probes.concepts import ConceptSet
from salience.core.serving import default_concepts as shipped
from salience.core.serving.concept_spec import load_spec


def test_the_shipped_set_serves_the_default_model_without_a_build(default_model: Path) -> None:
    """Fails after an edit of the default spec, its examples or the conversion, until
    `python -m tools.ship_default_concepts` has rebuilt the shipped file."""
    digest = shipped.spec_digest(load_spec(shipped.DEFAULT_SPEC))
    assert shipped.shipped_mismatch(default_model, digest) is None
    assert shipped.default_concepts(default_model) == shipped.SHIPPED
    concept_set = ConceptSet.load(shipped.SHIPPED)
    concept_set.check_model(default_model)
    assert concept_set.provenance["spec_digest"] == digest
    assert len(concept_set.layers) == 30 and concept_set.info, "every layer, with its held-out figures"


def test_another_model_or_an_edited_spec_is_told_why_it_builds(tiny_model: Path, default_model: Path) -> None:
    digest = shipped.spec_digest(load_spec(shipped.DEFAULT_SPEC))
    why = shipped.shipped_mismatch(tiny_model, digest)
    assert why is not None and why.startswith("the shipped set was built for the model "), why
    edited = shipped.shipped_mismatch(default_model, "0" * 12)
    assert edited == "the shipped set was built from another version of default.yaml (its examples changed)"


def test_a_start_waiting_on_another_build_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = tmp_path / "folder"
    building, release = threading.Event(), threading.Event()

    def slow_build(out: Path) -> None:
        building.set()
        release.wait(30)
        (out / "done").write_text("yes")

    builder = threading.Thread(target=build_folder_once, args=(target, slow_build))
    builder.start()
    assert building.wait(30)
    waiter_result: list[Path] = []
    with caplog.at_level(logging.INFO, logger="salience.core.models.atomic"):
        waiter = threading.Thread(
            target=lambda: waiter_result.append(build_folder_once(target, lambda out: pytest.fail("built twice")))
        )
        waiter.start()
        for _ in range(100):
            if any("waiting for another process to build folder" in r.getMessage() for r in caplog.records):
                break
            threading.Event().wait(0.05)
        release.set()
        builder.join(30)
        waiter.join(30)
    waiting = [r for r in caplog.records if "waiting for another process to build folder" in r.getMessage()]
    assert waiting, [r.getMessage() for r in caplog.records]
    assert waiting[0].builder_pid.isdigit()
    assert waiter_result == [target] and (target / "done").read_text() == "yes"
    assert any("the other build of folder ended" in r.getMessage() for r in caplog.records)


def test_a_build_of_the_default_spec_reproduces_the_shipped_set(default_model: Path, tmp_path: Path) -> None:
    """The shipped file is what this code builds (about a minute: the build a start runs where
    the shipped set does not fit), to float noise: every direction, calibration and figure."""
    out = tmp_path / "built.safetensors"
    shipped.build_default_concepts(default_model, out)
    built, ours = ConceptSet.load(out), ConceptSet.load(shipped.SHIPPED)
    assert built.concepts == ours.concepts and built.layers == ours.layers
    for layer in ours.layers:
        assert torch.allclose(built.vectors[layer], ours.vectors[layer], atol=1e-5), layer
    assert built.provenance["spec_digest"] == ours.provenance["spec_digest"]
    for made, kept in zip(built.info, ours.info, strict=True):
        assert made is not None and kept is not None
        assert (made["method"], made["recommended_layer"]) == (kept["method"], kept["recommended_layer"])
        for row, kept_row in zip(made["layers"], kept["layers"], strict=True):
            for key, value in kept_row.items():
                assert row[key] == pytest.approx(value, abs=1e-4), (made["name"], row["layer"], key)
