"""Every family Salience reads, compiled: a tiny random model of each (tests/tiny_families.py)
holds the numeric contract against transformers in float32 with hooks on its decoder layers.

Per family one compiled engine reads random concepts at three layers and serves an SAE: prompt
and decoded logprobs with their top-k, readouts (after a prefix-cache hit too), greedy tokens,
steering with every op, residual rows, SAE features and a monitor. The families the default model (Llama)
and the tiny model (Qwen2, Qwen2-VL) are do this in their own modules.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.engine.requests import FeatureRequest, FinishReason, Probes, ResidualRequest, SamplingOptions
from salience.core.features.sae import SparseAutoencoder, load_sae
from salience.core.models.atomic import build_folder_once
from salience.core.models.folders import model_family
from salience.core.models.home import salience_home
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.monitors import Action, Monitor
from salience.core.probes.steering import Intervention, Op
from salience.errors import ModelError
from tests.conftest import TINY_SOURCES, random_concepts
from tests.engines import EnginePool
from tests.random_sae import random_sae, stored
from tests.reference import (
    LONG_PROMPT,
    Reference,
    assert_logprobs_match,
    assert_readouts_close,
    check_rows_across_a_cache_hit,
    reference_readouts,
)
from tests.steer_reference import check_against_reference
from tests.test_features import assert_features, want_top
from tests.test_residuals import assert_rows
from tests.tiny_families import FAMILIES, build_family_model

LAYERS = (0, 2, 3)
CONCEPTS = ("alpha", "beta", "gamma")
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
SAE_LAYER, SAE_TOP = 2, 8
SOURCES = [Path(__file__).with_name("tiny_families.py"), *TINY_SOURCES]


def family_folder(family: str, tokenizer: Path, seed: int = 0) -> Path:
    """The family's tiny model (`seed`: its random weights), built once per cache."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    target = salience_home() / "test-models" / f"tiny-{family}-{seed}-{key}"
    return build_folder_once(target, lambda out: build_family_model(family, out, tokenizer, seed=seed))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def family_model(family: str, tiny_model: Path) -> Path:
    return family_folder(family, tiny_model)


@pytest.fixture(scope="module")
def concepts(family_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ConceptSet:
    path = tmp_path_factory.mktemp("concepts") / "family.safetensors"
    return random_concepts(family_model, CONCEPTS, LAYERS, 3, path)


@pytest.fixture(scope="session")
def family_sae(tmp_path_factory: pytest.TempPathFactory) -> SparseAutoencoder:
    root = tmp_path_factory.mktemp("family-sae")
    return load_sae(stored(random_sae(root / "top", "topk", SAE_LAYER, 256, 5, k=SAE_TOP)), name="top")


@pytest_asyncio.fixture(scope="module")
async def engine(
    engines: EnginePool, family: str, family_model: Path, concepts: ConceptSet, family_sae: SparseAutoencoder
) -> AsyncIterator[Engine]:
    async with engines.engine(
        family_model,
        (f"family[{family}]",),
        max_model_len=1024,
        concepts=concepts,
        saes=(family_sae,),
        sae_top=SAE_TOP,
        compile=True,
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(family_model: Path) -> Reference:
    return Reference(family_model)


async def test_it_runs_compiled(engine: Engine, family_model: Path) -> None:
    assert model_family(family_model).compiled and engine.compiled
    graph = await engine.readouts.graph()
    assert graph["taps"] == len(LAYERS) and not graph["graph_breaks"], graph


async def test_logprobs_readouts_and_greedy_equal_the_reference(
    engine: Engine, concepts: ConceptSet, reference: Reference
) -> None:
    """A prompt longer than two KV blocks, read whole; then again reading its decode only, which
    the prefix cache serves the prompt of."""
    prompt = LONG_PROMPT
    generation = engine.generate(prompt, GREEDY, probes=Probes(readout_ranges=[(0, 2000)]), prompt_logprobs=5)
    events = [e async for e in generation]
    ids = check_against_reference(reference, concepts, prompt, (), GREEDY, generation, events)
    again = engine.generate(prompt, GREEDY, probes=Probes(readout_ranges=[(len(prompt), 2000)]))
    events = [e async for e in again]
    assert again.cached_tokens == (len(prompt) - 1) // engine.block_size * engine.block_size > 0
    assert [e.token_id for e in events] == ids[len(prompt) :]
    assert_logprobs_match(events, reference.logprobs(ids).float(), GREEDY.logprobs)
    assert_readouts_close({e.position: e.readout for e in events}, reference_readouts(reference, concepts, ids))


STEERING = (
    Intervention(direction="alpha", layers=(0,), op=Op.ADD, value=3.0, prompt=True, generated=True),
    Intervention(direction="beta", layers=(2,), op=Op.SET, value=-1.5, generated=True),
    Intervention(direction="gamma", layers=(2,), op=Op.ABLATE, ranges=((3, 9),)),
    Intervention(direction="alpha", layers=(3,), op=Op.CAP, lo=-0.5, hi=0.5, prompt=True, generated=True),
)


async def test_every_steering_op_moves_it_as_the_reference(
    engine: Engine, concepts: ConceptSet, reference: Reference
) -> None:
    prompt = LONG_PROMPT[:40]
    probes = Probes(readout_ranges=[(0, 2000)], steer=STEERING)
    generation = engine.generate(prompt, GREEDY, probes=probes, prompt_logprobs=5)
    events = [e async for e in generation]
    check_against_reference(reference, concepts, prompt, STEERING, GREEDY, generation, events)


async def test_residual_rows_and_features_equal_the_reference(
    engine: Engine, concepts: ConceptSet, reference: Reference, family_sae: SparseAutoencoder
) -> None:
    prompt = LONG_PROMPT[:30]
    probes = Probes(
        readout_ranges=[(0, 2000)],
        residual=ResidualRequest(layers=(0, 3), ranges=((0, 2000),)),
        features=FeatureRequest(sae="top", k=SAE_TOP, ranges=((0, 2000),)),
    )
    generation = engine.generate(prompt, GREEDY, probes=probes)
    events = [e async for e in generation]
    assert len(events) == GREEDY.max_tokens
    ids = prompt + [e.token_id for e in events]
    rows = {**generation.prompt_residuals, **{e.position: e.residual for e in events}}
    assert sorted(rows) == list(range(len(ids)))
    assert_rows(rows, reference, ids, (0, 3))
    features = {**generation.prompt_rows["features"], **{e.position: e.features for e in events}}
    assert sorted(features) == list(range(len(ids)))
    assert_features(features, want_top(reference, family_sae, ids), SAE_TOP)
    assert_readouts_close(
        {**generation.prompt_readouts, **{e.position: e.readout for e in events}},
        reference_readouts(reference, concepts, ids),
    )


async def test_rows_after_a_prefix_cache_hit_equal_the_reference(engine: Engine, reference: Reference) -> None:
    await check_rows_across_a_cache_hit(
        engine,
        "residual",
        lambda start: Probes(residual=ResidualRequest(layers=(2,), ranges=((start, 2000),))),
        lambda rows, ids: assert_rows(rows, reference, ids, (2,)),
    )


def test_a_set_built_for_other_weights_of_the_same_shape_is_refused(
    family: str, family_model: Path, concepts: ConceptSet, tiny_model: Path
) -> None:
    other = family_folder(family, tiny_model, seed=1)
    concepts.check_model(family_model)
    with pytest.raises(ModelError, match="concept set was built for model"):
        concepts.check_model(other)


async def test_a_monitor_stops_where_the_reference_first_passes_its_threshold(
    engine: Engine, reference: Reference, family_sae: SparseAutoencoder
) -> None:
    """A feature monitor (it needs no calibration, which random concepts lack) on the SAE's feature
    that peaks on the third generated token: the generation stops at the first token whose
    reference activation passes half that peak, the tokens up to it the reference's."""
    prompt = LONG_PROMPT[:30]
    ids = prompt + reference.greedy(prompt, GREEDY.max_tokens)
    acts = want_top(reference, family_sae, ids)[len(prompt) :]
    feature = int(acts[2].argmax())
    threshold = float(acts[2, feature]) / 2
    first = next(i for i in range(len(acts)) if acts[i, feature] > threshold)
    monitor = Monitor(concept="", feature=feature, sae="top", above=threshold, action=Action.STOP)
    events = [e async for e in engine.generate(prompt, GREEDY, probes=Probes(monitors=[monitor]))]
    assert len(events) == first + 1 and events[-1].finish_reason is FinishReason.MONITOR
    assert [e.token_id for e in events] == ids[len(prompt) : len(prompt) + first + 1]
    stop = events[-1].stopped_by
    assert stop is not None and (stop.feature, stop.layer, stop.position) == (feature, SAE_LAYER, len(prompt) + first)
    assert abs(stop.probability - float(acts[first, feature])) <= 1e-4 * max(1.0, abs(float(acts[first, feature])))
