"""Every family Salience reads, compiled: a tiny random model of each (tests/tiny_families.py)
holds the numeric contract against transformers in float32 with hooks on its decoder layers.

Per family one compiled engine reads random concepts at three layers and serves an SAE, and an SAE
at each other hook point the family has: prompt and decoded logprobs with their top-k, readouts
(after a prefix-cache hit too), greedy tokens, steering with every op, residual rows, SAE features
at every point and a monitor. The families the default model (Llama)
and the tiny model (Qwen2, Qwen2-VL) are do this in their own modules.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import FeatureRequest, FinishReason, Probes, ResidualRequest, SamplingOptions
from salience.core.features.sae import SparseAutoencoder, load_sae
from salience.core.models.atomic import build_folder_once
from salience.core.models.folders import model_family
from salience.core.models.home import salience_home
from salience.core.models.points import Point, Site
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.monitors import Action, Monitor
from salience.core.probes.patching import Patch
from salience.core.probes.steering import Intervention, Op
from salience.errors import ModelError
from tests import sae_reference
from tests.conftest import TINY_SOURCES, random_concepts
from tests.engines import EnginePool
from tests.random_sae import random_sae, random_transcoder, stored
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


# The point each family's concept set reads (and steering, and residual rows, act at): every point
# on some family, each where its family's layer puts it somewhere of its own (a fused norm's
# input pair, a post-norm's output, a transformers module's tuple output, the layer's input).
CONCEPT_POINTS: dict[str, Point] = {
    "qwen3": "resid_mid",
    "mistral": "resid_pre",
    "gpt2": "resid_pre",
    "gemma2": "attn_out",
    "gpt_neox": "attn_out",
    "gemma3": "mlp_out",
    "olmo2": "mlp_in",
    "phi3": "mlp_in",
}


@pytest.fixture(scope="module")
def concepts(family: str, family_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ConceptSet:
    path = tmp_path_factory.mktemp("concepts") / "family.safetensors"
    return random_concepts(family_model, CONCEPTS, LAYERS, 3, path, point=CONCEPT_POINTS.get(family, "resid_post"))


@pytest.fixture(scope="session")
def family_sae(tmp_path_factory: pytest.TempPathFactory) -> SparseAutoencoder:
    root = tmp_path_factory.mktemp("family-sae")
    return load_sae(stored(random_sae(root / "top", "topk", SAE_LAYER, 256, 5, k=SAE_TOP)), name="top")


# An SAE at each point but resid_post (family_sae's), each at a layer of its own where it can be:
# resid_pre at layer 0 reads the embeddings as the model scales them. The one at mlp_in is a
# transcoder, as SAEs there are.
POINT_LAYERS: dict[Point, int] = {"resid_pre": 0, "resid_mid": 1, "attn_out": 3, "mlp_in": 0, "mlp_out": 1}


@pytest.fixture(scope="session")
def every_point_sae(tmp_path_factory: pytest.TempPathFactory) -> dict[Point, SparseAutoencoder]:
    root = tmp_path_factory.mktemp("point-saes")

    def folder(point: Point, layer: int) -> Path:
        if point == "mlp_in":
            return random_transcoder(root / point, layer, 64, 7)
        return random_sae(root / point, "topk", layer, 64, 7, point=point, k=SAE_TOP)

    saes = {point: load_sae(stored(folder(point, layer)), name=point) for point, layer in POINT_LAYERS.items()}
    assert saes["mlp_in"].transcoder == "transcoder"
    return saes


@pytest.fixture(scope="module")
def point_saes(family_model: Path, every_point_sae: dict[Point, SparseAutoencoder]) -> list[SparseAutoencoder]:
    """The SAEs at the points the family has."""
    points = model_family(family_model).vllm_points
    return [sae for point, sae in every_point_sae.items() if point in points]


@pytest_asyncio.fixture(scope="module")
async def engine(
    engines: EnginePool,
    family: str,
    family_model: Path,
    concepts: ConceptSet,
    family_sae: SparseAutoencoder,
    point_saes: list[SparseAutoencoder],
) -> AsyncIterator[Engine]:
    async with engines.engine(
        family_model,
        (f"family[{family}]",),
        max_model_len=1024,
        concepts=concepts,
        saes=(family_sae, *point_saes),
        sae_top=SAE_TOP,
        patch_points=tuple(model_family(family_model).vllm_points),
        compile=True,
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(family_model: Path) -> Reference:
    return Reference(family_model)


async def test_it_runs_compiled(
    engine: Engine,
    family_model: Path,
    concepts: ConceptSet,
    family_sae: SparseAutoencoder,
    point_saes: list[SparseAutoencoder],
) -> None:
    """One tap per site read or patched: the concept set's layers at its point, each SAE's site,
    and every layer of every point (the patch points)."""
    family = model_family(family_model)
    assert family.compiled and engine.compiled
    graph = await engine.readouts.graph()
    sites = {Site(layer, point) for layer in range(4) for point in family.vllm_points}
    assert graph["taps"] == len(sites) and not graph["graph_breaks"], graph


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
    assert_rows(rows, reference, ids, (0, 3), concepts.point)
    features = {**generation.prompt_rows["features"], **{e.position: e.features for e in events}}
    assert sorted(features) == list(range(len(ids)))
    assert_features(features, want_top(reference, family_sae, ids), SAE_TOP)
    assert_readouts_close(
        {**generation.prompt_readouts, **{e.position: e.readout for e in events}},
        reference_readouts(reference, concepts, ids),
    )


def test_the_references_points_add_up_to_transformers_hidden_states(reference: Reference, family_model: Path) -> None:
    """The reference's hooks (where each family's `hf_points` say each point is) against what
    transformers says itself: resid_pre and resid_post are its hidden_states (the first the scaled
    embeddings), and what attention and the MLP add sums to them, through resid_mid unless the
    residual is parallel. Granite's adds are scaled outside any module, which is why it has no
    attn_out or mlp_out."""
    points = model_family(family_model).hf_points
    ids = LONG_PROMPT[:20]
    found = reference.at(ids, [Site(layer, point) for layer in range(4) for point in points])
    with torch.no_grad():
        hidden = reference.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for layer in range(4):
        at = {point: found[Site(layer, point)] for point in points}
        torch.testing.assert_close(at["resid_pre"], hidden[layer][0].double(), rtol=0, atol=1e-6)
        if layer < 3:  # transformers' last hidden state has the final norm applied
            torch.testing.assert_close(at["resid_post"], hidden[layer + 1][0].double(), rtol=0, atol=1e-6)
        if "attn_out" not in at:
            continue
        if "resid_mid" in at:
            torch.testing.assert_close(at["resid_pre"] + at["attn_out"], at["resid_mid"], rtol=0, atol=1e-5)
            torch.testing.assert_close(at["resid_mid"] + at["mlp_out"], at["resid_post"], rtol=0, atol=1e-5)
        else:
            added = at["resid_pre"] + at["attn_out"] + at["mlp_out"]
            torch.testing.assert_close(added, at["resid_post"], rtol=0, atol=1e-5)


async def test_features_at_every_point_equal_the_reference(
    engine: Engine, reference: Reference, point_saes: list[SparseAutoencoder], family_model: Path
) -> None:
    """Each SAE encodes the stream at its own point (TransformerLens's hook there, in transformers):
    the points sit in different modules of each family's layer, and a point read wrongly (the
    module's input for its output, a norm's output for its input, a pair without its residual)
    gives other features."""
    absent = set(POINT_LAYERS) - set(model_family(family_model).vllm_points)
    assert len(point_saes) == len(POINT_LAYERS) - len(absent)
    prompt = LONG_PROMPT[:30]
    ids = prompt + reference.greedy(prompt, GREEDY.max_tokens)
    want = reference.at(ids, [sae.site for sae in point_saes])

    async def features(sae: SparseAutoencoder) -> dict[int, tuple]:
        ask = Probes(features=FeatureRequest(sae=sae.name, k=SAE_TOP, ranges=((0, 2000),)))
        generation = engine.generate(prompt, GREEDY, probes=ask)
        events = [e async for e in generation]
        assert [e.token_id for e in events] == ids[len(prompt) :]
        return {**generation.prompt_rows["features"], **{e.position: e.features for e in events}}

    got = await asyncio.gather(*(features(sae) for sae in point_saes))
    for sae, rows in zip(point_saes, got, strict=True):
        assert sorted(rows) == list(range(len(ids))), sae.name
        acts = sae_reference.encode(sae_reference.read_folder(sae.folder), want[sae.site].numpy())
        assert_features(rows, torch.from_numpy(acts), SAE_TOP)


def random_rows(n: int, seed: int) -> bytes:
    """`n` rows of the tiny models' hidden size, of a residual's scale."""
    return (2 * torch.randn(n, 128, generator=torch.Generator().manual_seed(seed))).numpy().tobytes()


async def test_patches_at_every_point_move_it_as_the_reference(
    engine: Engine, reference: Reference, family_model: Path
) -> None:
    """At each point the family has, two patches (a row per position at one layer, one row for
    several positions at the next: a mean ablation), run side by side in one batch: the logprobs
    and top-k of every position, and the rows read at that point of the last layer, equal
    transformers' with the same activations set by hooks."""
    ids = LONG_PROMPT[:24]
    points = list(model_family(family_model).vllm_points)

    async def run(point: Point, patches: tuple[Patch, ...]):
        asked = ResidualRequest(layers=(3,), ranges=((0, len(ids)),), point=point)
        return await engine.prefill(ids, top_logprobs=5, probes=Probes(patch=patches, residual=asked))

    patches = {
        point: (
            Patch(point=point, layer=1, positions=(3, 10, 23), rows=random_rows(3, n)),
            Patch(point=point, layer=2, positions=(5, 6, 7, 8), rows=random_rows(1, 100 + n)),
        )
        for n, point in enumerate(points)
    }
    results = await asyncio.gather(*(run(point, patches[point]) for point in points))
    for point, scores in zip(points, results, strict=True):
        want, at = reference.patched(ids, patches[point], [Site(3, point)])
        assert (want - reference.logprobs(ids)).abs().max() > 1e-2, f"the patches at {point} change nothing"
        events = [scores.at(position) for position in range(1, len(ids))]
        assert_logprobs_match(events, want.float(), 5)
        rows = scores.residuals
        assert sorted(rows) == list(range(len(ids))), point
        for position, row in rows.items():
            expected = at[Site(3, point)][position].numpy()
            error = np.abs(row[0] - expected).max() / np.abs(expected).max()
            assert error < 1e-4, (point, position, error)


async def test_restoring_a_stream_point_at_every_position_restores_the_clean_run(
    engine: Engine, reference: Reference, family_model: Path
) -> None:
    """The clean run's rows at resid_pre of layer 2 (read at that point), patched into a corrupted
    prompt at every position: what follows is the clean run's, logprobs equal within 1e-4; the
    corrupted run's differ."""
    clean = LONG_PROMPT[:20]
    corrupted = [clean[0], *[(t + 7) % 1900 for t in clean[1:6]], *clean[6:]]
    asked = ResidualRequest(layers=(2,), ranges=((0, len(clean)),), point="resid_pre")
    rows = (await engine.prefill(clean, top_logprobs=5, probes=Probes(residual=asked))).residuals
    values = np.stack([rows[p][0] for p in range(len(clean))]).astype(np.float32).tobytes()
    restore = Patch(point="resid_pre", layer=2, positions=tuple(range(len(clean))), rows=values)
    restored = await engine.prefill(corrupted, top_logprobs=5, probes=Probes(patch=(restore,)))
    assert_logprobs_match([restored.at(p) for p in range(1, len(clean))], reference.logprobs(clean).float(), 5)
    plain = await engine.prefill(corrupted, top_logprobs=5)  # the corrupted run itself differs
    assert max(abs(plain.at(p).logprob - restored.at(p).logprob) for p in range(6, len(clean))) > 1e-3


async def test_rows_after_a_prefix_cache_hit_equal_the_reference(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    await check_rows_across_a_cache_hit(
        engine,
        "residual",
        lambda start: Probes(residual=ResidualRequest(layers=(2,), ranges=((start, 2000),))),
        lambda rows, ids: assert_rows(rows, reference, ids, (2,), concepts.point),
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
