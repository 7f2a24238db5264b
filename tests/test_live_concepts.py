"""Live concepts on the tiny model: defined on the running engine, read and steered like loaded ones,
checked against transformers float32 with the same vectors; and every way a define can be refused."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.probes.calibration import ReadoutView
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.steering import Intervention, Op
from salience.core.serving import live_concepts
from salience.core.serving.concept_builder import fit_concept
from salience.core.serving.live_concepts import VALIDATION, ConceptDefinition
from salience.core.serving.status import ServerStatus
from salience.errors import ContextOverflow, InvalidArgument, ResourceExhausted, Unavailable
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS, drop_live_concepts, start_engine
from tests.reference import Reference, assert_readouts_close, reference_readouts
from tests.steer_reference import check_against_reference
from tests.test_steering import in_one_step, run

SPARE = 3
PROMPT = [0, *range(70, 101)]
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest_asyncio.fixture(scope="module", params=["eager", "compiled"])
async def engine(request: pytest.FixtureRequest, tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Engine]:
    engine = await start_engine(  # a configuration of this module's own: not shared
        tiny_model,
        max_model_len=1024,
        concepts=tiny_concepts,
        compile=request.param == "compiled",
        spare_concepts=SPARE,
        steer_vectors=2,
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def status(engine: Engine) -> ServerStatus:
    status = ServerStatus("tiny")
    status.ready(engine)
    return status


@pytest_asyncio.fixture(autouse=True)
async def no_live_concepts_left(engine: Engine) -> AsyncIterator[None]:
    yield
    await drop_live_concepts(engine)


def vectors(seed: int, scale: float = 3.0) -> dict[int, torch.Tensor]:
    """A concept's vectors, one per read layer, deliberately not unit: readouts use them as given."""
    generator = torch.Generator().manual_seed(seed)
    return {layer: scale * torch.randn(128, generator=generator) for layer in TINY_LAYERS}


def as_bytes(vectors: dict[int, torch.Tensor]) -> dict[int, bytes]:
    return {layer: v.numpy().astype(np.float32).tobytes() for layer, v in vectors.items()}


def extended(concepts: ConceptSet, *live: tuple[str, dict[int, torch.Tensor]]) -> ConceptSet:
    """The loaded set with live concepts appended: what the reference reads."""
    return dataclasses.replace(
        concepts,
        concepts=(*concepts.concepts, *(name for name, _ in live)),
        vectors={
            layer: torch.cat([concepts.vectors[layer], *(v[layer][None] for _, v in live)]) for layer in concepts.layers
        },
        info=(),
    )


async def define(status: ServerStatus, name: str, given: dict[int, torch.Tensor]) -> dict:
    definition = ConceptDefinition(name=name, vectors=as_bytes(given))
    return await live_concepts.define(status, definition, frontend="test")


def steer(direction: str, layers, op: str, value: float = 0.0, **fields) -> Intervention:
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    return Intervention(direction=direction, layers=layers, op=Op(op), value=value, **fields)


async def test_a_live_concept_reads_and_steers_like_the_reference_without_a_new_graph(
    engine: Engine, status: ServerStatus, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    before = await engine.readouts.graph()
    zeta = vectors(7)
    reply = await define(status, "zeta", zeta)
    assert reply["version"] == engine.live.view().version and reply["concept_info"] == {"name": "zeta", "live": True}
    manifest = engine.readouts.manifest
    assert manifest.concepts == (*TINY_CONCEPTS, "zeta") and manifest.live == ("zeta",)
    reference_set = extended(tiny_concepts, ("zeta", zeta))
    interventions = [steer("zeta", 2, "add", 5.0, prompt=True, generated=True)]
    generation, events = await run(engine, PROMPT, interventions, GREEDY)
    assert len(events[0].readout) == len(TINY_LAYERS) * (len(TINY_CONCEPTS) + 1)
    check_against_reference(tiny_reference, reference_set, PROMPT, interventions, GREEDY, generation, events)
    # set and cap along it too
    capped = [steer("zeta", (0, 3), "cap", lo=-1.0, hi=1.5, prompt=True, generated=True)]
    generation, events = await run(engine, PROMPT, capped, GREEDY)
    check_against_reference(tiny_reference, reference_set, PROMPT, capped, GREEDY, generation, events)
    after = await engine.readouts.graph()
    assert after["graphs"] == before["graphs"] and after["graph_breaks"] == before["graph_breaks"]


async def test_a_stream_keeps_its_concepts_across_a_define_and_a_delete(
    engine: Engine, status: ServerStatus, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    eta = vectors(11)
    await define(status, "eta", eta)
    options = SamplingOptions(max_tokens=24, temperature=0.0, ignore_eos=True)
    generation = engine.generate(PROMPT, options, probes=Probes(readout_ranges=[(0, 2000)]))
    events = []
    async for event in generation:
        events.append(event)
        if len(events) == 3:
            engine.live.delete("eta")  # its column stays until this stream ends
            await define(status, "theta", vectors(12))  # takes another column
            await engine.live.settled()
    width = len(TINY_LAYERS) * (len(TINY_CONCEPTS) + 1)
    assert all(len(e.readout) == width for e in events)
    ids = PROMPT + [e.token_id for e in events]
    want = reference_readouts(tiny_reference, extended(tiny_concepts, ("eta", eta)), ids)
    assert_readouts_close({e.position: e.readout for e in events}, want)
    assert_readouts_close(generation.prompt_readouts, want)
    assert engine.readouts.manifest.concepts == (*TINY_CONCEPTS, "theta")


async def test_a_deleted_concepts_column_reads_and_writes_nothing(
    engine: Engine, status: ServerStatus, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    def spare_columns() -> list[float]:
        """The largest magnitude in every column past the loaded concepts and named directions, every tap."""
        return [value for values in norms.values() for value in values[len(TINY_CONCEPTS) :]]

    await define(status, "iota", vectors(13))
    (norms,) = await engine._llm.collective_rpc("salience_column_norms")
    assert sum(value > 0 for value in spare_columns()) == len(norms)  # iota's column, at every tap
    engine.live.delete("iota")
    await engine.live.settled()
    (norms,) = await engine._llm.collective_rpc("salience_column_norms")
    assert all(value == 0.0 for value in spare_columns()), norms
    # Unsteered and unread, the model is the loaded set's: exactly the reference.
    generation, events = await run(engine, PROMPT, [], GREEDY)
    check_against_reference(tiny_reference, tiny_concepts, PROMPT, [], GREEDY, generation, events)


async def test_request_vectors_and_caps_match_the_reference_batched_with_named_directions(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    one, two = (v[2].numpy().astype(np.float32).tobytes() for v in (vectors(21), vectors(22)))
    cases = [
        [Intervention(direction="", vector=one, layers=(2,), op=Op.ADD, value=4.0, prompt=True, generated=True)],
        [
            Intervention(direction="", vector=two, layers=(0, 2), op=Op.CAP, hi=0.5, generated=True),
            steer("beta", 3, "set", 2.0, prompt=True),
        ],
        [steer("alpha", 2, "cap", lo=-0.25, hi=0.25, prompt=True, generated=True)],
        [Intervention(direction="", vector=one, layers=(3,), op=Op.ABLATE, ranges=((5, 30),))],
    ]
    results = await in_one_step(engine, [run(engine, PROMPT, case, GREEDY) for case in cases])
    for case, (generation, events) in zip(cases, results, strict=True):
        check_against_reference(tiny_reference, tiny_concepts, PROMPT, case, GREEDY, generation, events)
    assert engine.live._vectors.in_use() == 0  # every vector column is free again


async def test_a_concept_fitted_from_examples_is_the_builders_fit_of_the_references_residuals(
    engine: Engine, status: ServerStatus, tiny_model: Path, tiny_reference: Reference
) -> None:
    positive = [f"alpha beta {i} gamma {i * 7} delta" for i in range(6)]
    negative = [f"one two three {i} four {i * 3} five six" for i in range(6)]
    definition = ConceptDefinition(name="kappa", positive=positive, negative=negative, method="diff_means")
    reply = await live_concepts.define(status, definition, frontend="test")
    info = reply["concept_info"]
    assert info["live"] and info["method"] == "diff_means" and len(info["layers"]) == len(TINY_LAYERS)
    assert "layer  auroc" in reply["table"]
    # The reference: transformers' residuals of the same texts, through the builder's own fit.
    residuals = {}
    for text in positive + negative:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        by_layer = tiny_reference.residuals(ids, TINY_LAYERS)
        residuals[text] = torch.stack([by_layer[layer][1:] for layer in TINY_LAYERS], dim=1).float()
    concept = {"name": "kappa", "method": "diff_means", "positive": positive, "negative": negative}
    want, want_info = fit_concept(concept, TINY_LAYERS, residuals, tiny_model, engine.tokenizer, VALIDATION)
    (live,) = engine.live.table.live()
    for i, layer in enumerate(TINY_LAYERS):
        assert torch.allclose(live.vectors[layer], want[i], atol=1e-4)
    for got, ref in zip(info["layers"], want_info["layers"], strict=True):
        assert got["auroc"] == pytest.approx(ref["auroc"], abs=1e-6)
        assert got["scale"] == pytest.approx(ref["scale"], rel=1e-3)
    # Calibrated: it reads as a probability, through its calibration; the hand-made set's concepts read None.
    raw = await engine.prefill(PROMPT, probes=Probes(readout_ranges=[(1, 4)]))
    probabilities = await engine.prefill(PROMPT, probes=Probes(readout_ranges=[(1, 4)], readout_view=ReadoutView.TOKEN))
    running = await engine.prefill(PROMPT, probes=Probes(readout_ranges=[(1, 4)], readout_view=ReadoutView.RUNNING))
    width = len(TINY_CONCEPTS) + 1
    for position, row in probabilities.readouts.items():
        for slot, fit in enumerate(info["layers"]):
            for k, p in enumerate(row[slot * width : (slot + 1) * width]):
                if k < len(TINY_CONCEPTS):
                    assert p is None and running.readouts[position][slot * width + k] is None
                else:
                    x = raw.readouts[position][slot * width + k]
                    assert p == pytest.approx(1 / (1 + math.exp(-(fit["scale"] * x + fit["offset"]))), rel=1e-9)
                    mean = sum(raw.readouts[q][slot * width + k] for q in range(1, position + 1)) / position
                    z = fit["running_scale"] * mean + fit["running_offset"]
                    assert running.readouts[position][slot * width + k] == pytest.approx(
                        1 / (1 + math.exp(-z)), rel=1e-9
                    )


async def test_a_define_refuses_examples_beyond_the_residual_limit(
    engine: Engine, status: ServerStatus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A define reads each example at every read layer in one request: --max-residual-rows bounds
    its length, with an error about examples rather than residual rows."""
    monkeypatch.setattr(engine.settings, "max_residual_rows", 10 * len(TINY_LAYERS))
    version = engine.live.view().version
    definition = ConceptDefinition(name="mu", positive=["a b " * 20] * 4, negative=["c d e"] * 4)
    with pytest.raises(InvalidArgument, match=r"allows 11 tokens per example \(--max-residual-rows\)"):
        await live_concepts.define(status, definition, frontend="test")
    assert engine.live.view().version == version


async def test_every_bad_define_is_refused_and_changes_nothing(engine: Engine, status: ServerStatus) -> None:
    good = as_bytes(vectors(31))
    await define(status, "lambda", vectors(30))
    version = engine.live.view().version
    cases = [
        (ConceptDefinition(name="lambda", vectors=good), InvalidArgument, "exists already"),
        (ConceptDefinition(name="alpha", vectors=good), InvalidArgument, "a concept of the loaded set"),
        (ConceptDefinition(name=" x", vectors=good), InvalidArgument, "concept name"),
        (ConceptDefinition(name="mu", positive=["a b"] * 3, negative=["c d"] * 4), InvalidArgument, "4 to 256"),
        (ConceptDefinition(name="mu", vector=b"\0" * 4 * 127), InvalidArgument, "hidden size is 128"),
        (ConceptDefinition(name="mu", vector=np.full(128, np.nan, np.float32).tobytes()), InvalidArgument, "NaN"),
        (ConceptDefinition(name="mu", vector=np.full(128, np.inf, np.float32).tobytes()), InvalidArgument, "inf"),
        (ConceptDefinition(name="mu", vector=np.zeros(128, np.float32).tobytes()), InvalidArgument, "zero"),
        (ConceptDefinition(name="mu", vectors={0: good[0]}), InvalidArgument, "every read layer"),
        (
            ConceptDefinition(name="mu", positive=["a b " * 600] * 4, negative=["c d e"] * 4),
            ContextOverflow,
            "context is 1024",
        ),
        (
            ConceptDefinition(name="mu", positive=["a b c"] * 4, negative=["c d e"] * 4, layers=(1,)),
            InvalidArgument,
            "read layers",
        ),
        (ConceptDefinition(name="mu", vector=good[0], positive=["a b c"] * 4), InvalidArgument, "not both"),
    ]
    for definition, error, words in cases:
        with pytest.raises(error, match=words):
            await live_concepts.define(status, definition, frontend="test")
        assert engine.live.view().version == version
    with pytest.raises(InvalidArgument, match="no live concept named"):
        await live_concepts.delete(status, "mu")
    with pytest.raises(InvalidArgument, match="only live concepts"):
        await live_concepts.delete(status, "alpha")
    # The columns run out: SPARE of them, one held by "lambda".
    for n in range(SPARE - 1):
        await define(status, f"nu{n}", vectors(40 + n))
    with pytest.raises(ResourceExhausted, match=f"{SPARE} spare columns"):
        await define(status, "xi", vectors(50))
    status.draining()
    with pytest.raises(Unavailable, match="draining"):
        await define(status, "omicron", vectors(51))
    assert engine.live.view().concepts == (*TINY_CONCEPTS, "lambda", "nu0", "nu1")


async def test_concurrent_defines_of_one_name_exactly_one_wins(engine: Engine, status: ServerStatus) -> None:
    results = await asyncio.gather(
        define(status, "pi", vectors(60)),
        define(status, "pi", vectors(61)),
        define(status, "rho", vectors(62)),
        return_exceptions=True,
    )
    assert isinstance(results[0], dict) and isinstance(results[2], dict)
    assert isinstance(results[1], InvalidArgument) and "exists already" in str(results[1])
    assert engine.live.view().live == {"pi", "rho"}


async def test_saved_and_served_again_the_numbers_are_the_same(
    engine: Engine, status: ServerStatus, tiny_model: Path, tmp_path: Path
) -> None:
    if engine.compiled:
        pytest.skip("one restart is enough: the eager engine's")
    await define(status, "sigma", vectors(70))
    live = await engine.readout(PROMPT, [(0, len(PROMPT))])
    path = tmp_path / "saved.safetensors"
    path.write_bytes(live_concepts.save(status))
    saved = ConceptSet.load(path)
    saved.check_model(tiny_model)
    assert saved.concepts == (*TINY_CONCEPTS, "sigma")
    again = await start_engine(tiny_model, max_model_len=1024, concepts=saved)
    try:
        restarted = await again.readout(PROMPT, [(0, len(PROMPT))])
    finally:
        again.shutdown()
    for position, row in live.items():
        assert restarted[position] == pytest.approx(row, rel=1e-5, abs=1e-6)
