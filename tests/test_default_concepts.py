"""The default concept set ships with the package and serves the default model as it is; any
other model, or an edited spec, gets a set built once, and the log says why. A build that another
process is running makes a start wait, saying so."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch

from salience.core.models.atomic import build_folder_once
from salience.core.models.folders import model_fingerprint
from salience.core.probes.concepts import ConceptSet
from salience.core.serving import default_concepts as shipped
from salience.core.serving.concept_builder import build_concept_set
from salience.core.serving.concept_spec import load_spec
from salience.lmtp.client import LmtpClient
from tests.reference import Reference, assert_readouts_close, reference_readouts
from tests.test_drain import serve
from tests.test_families import family_folder


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


# Each concept is fitted on its own texts and the background alone, so these two rebuild exactly as
# in the whole build: one of each method the shipped set chose (the rest of the spec's tokens
# cost a minute more and test no other code; its digest is the first test's, and the whole
# spec's build runs end to end on the tiny GPT-2 below).
REBUILT = ("code", "question")  # in spec order


def test_a_build_of_the_default_spec_reproduces_the_shipped_set(default_model: Path) -> None:
    """What this code builds is the shipped file to float noise: every direction, calibration and
    figure of the concepts REBUILT, fitted from the default spec by the builder that
    `build_default_concepts` runs (its provenance is checked where it runs whole, below)."""
    spec = load_spec(shipped.DEFAULT_SPEC)
    part = {**spec, "concepts": [c for c in spec["concepts"] if c["name"] in REBUILT]}
    built, ours = asyncio.run(build_concept_set(part, default_model)), ConceptSet.load(shipped.SHIPPED)
    assert built.concepts == REBUILT and built.layers == ours.layers
    kept_info = {info["name"]: info for info in ours.info}
    assert {kept_info[name]["method"] for name in REBUILT} == {"logreg", "diff_means"}
    rows = [ours.concepts.index(name) for name in REBUILT]
    for layer in ours.layers:
        assert torch.allclose(built.vectors[layer], ours.vectors[layer][rows], atol=1e-5), layer
    for made in built.info:
        kept = kept_info[made["name"]]
        assert (made["method"], made["recommended_layer"]) == (kept["method"], kept["recommended_layer"])
        for row, kept_row in zip(made["layers"], kept["layers"], strict=True):
            assert row.keys() == kept_row.keys()
            for key, value in kept_row.items():
                assert row[key] == pytest.approx(value, abs=1e-4), (made["name"], row["layer"], key)


async def test_a_model_of_another_family_gets_the_default_set_built_at_its_first_start(tiny_model: Path) -> None:
    """`salience serve --model DIR` with no --concepts, on a GPT-2 whose set is not cached yet:
    the start says it builds, shows the build's progress, waits for it, and serves the six
    default concepts with their held-out figures; the readouts are the built vectors read on
    transformers' layer outputs. The set is then cached by the model's fingerprint."""
    model = family_folder("gpt2", tiny_model)
    spec = load_spec(shipped.DEFAULT_SPEC)
    cached = shipped.cache_folder(model, spec)
    assert model_fingerprint(model)[:16] in cached.name and shipped.spec_digest(spec) in cached.name
    shutil.rmtree(cached, ignore_errors=True)
    async with serve(model) as served:
        output = served.output()
        assert f"building the default concept set for {model.name} once" in output, output
        assert "the start waits for it, --no-readouts skips it" in output
        assert "reading example texts: 100%" in output and "fitting and validating: 100%" in output, output
        client = await LmtpClient.connect(served.http.replace("http", "ws") + "/")
        try:
            manifest = (await client.request("MODEL_INFO"))["model_info"]["readout_manifest"]
            concept_set = ConceptSet.load(cached / "concepts.safetensors")
            assert concept_set.provenance["spec_digest"] == shipped.spec_digest(spec)
            assert manifest["concepts"] == [c["name"] for c in spec["concepts"]] == list(concept_set.concepts)
            assert manifest["layers"] == list(concept_set.layers) == list(range(4))
            assert [c["recommended_layer"] for c in manifest["concept_info"]] == [
                info["recommended_layer"] for info in concept_set.info
            ]
            prompt = [5, 17, 42, 99, 7, 300, 12]
            fields = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "readout": [[0, 100]]}
            payloads = [p async for p in client.stream("GENERATE", **fields)]
        finally:
            await client.close()
    assert sum(1 for p in payloads if not p.get("prompt")) == 4
    ids = [p["token"] for p in payloads]
    want = reference_readouts(Reference(model), concept_set, ids)
    assert [p["position"] for p in payloads] == list(range(len(ids)))
    assert_readouts_close({p["position"]: p["readout"] for p in payloads}, want)
    assert shipped.default_concepts(model) == cached / "concepts.safetensors", "built once, then read"
