"""Pipeline parallelism (PP=2 on the two CPU cores): readouts from both stages, merged exactly.

The tiny model's four layers split into stage 0 (layers 0-1) and stage 1 (layers 2-3); the
readout layers (TINY_LAYERS: 0, 2, 3) lie on both, so every readout row is assembled from two
workers' blocks. Everything is compared with the transformers float32 reference.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.probes.concepts import ConceptSet
from tests.conftest import TINY_LAYERS, start_engine
from tests.reference import (
    Reference,
    assert_readout_close,
    check_concurrent_ranges,
    check_score_readouts,
    reference_readouts,
)
from tests.steer_reference import check_against_reference
from tests.test_steering import run, steer

pytestmark = pytest.mark.multiprocess

PROMPTS = [[0, *range(60 + 11 * i, 90 + 11 * i)] for i in range(8)]
GREEDY = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Engine]:
    engine = await start_engine(
        tiny_model, max_model_len=1024, concepts=tiny_concepts, pipeline_parallel_size=2, compile=False
    )
    yield engine
    engine.shutdown()


async def test_both_stages_file_their_layers(engine: Engine) -> None:
    graph = await engine.readouts.graph()
    assert graph["taps"] == len(TINY_LAYERS)  # layer 0 on stage 0, layers 2 and 3 on stage 1
    assert sorted(engine.readouts._masks) == [0, 1]


async def test_prompt_decode_and_logprobs_match_reference(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    generation, events = await run(engine, PROMPTS[0], (), GREEDY)
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[0], (), GREEDY, generation, events)


async def test_prefix_cache_hit_still_gives_every_position(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    prompt = [0, *[(7 * j) % 1900 + 5 for j in range(600)]]  # several 128-token KV blocks
    options = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)
    [e async for e in engine.generate(prompt, options)]
    cached = engine.generate(prompt, options, probes=Probes(readout_ranges=[(len(prompt), len(prompt) + 2)]))
    events = [e async for e in cached]
    assert cached.cached_tokens >= 512  # decoded positions only: the cache is read
    ids = prompt + [e.token_id for e in events]
    want = reference_readouts(tiny_reference, tiny_concepts, ids)
    assert [e.position for e in events if e.readout is not None] == [len(prompt), len(prompt) + 1]
    for event in events:
        assert_readout_close(event.readout, want[event.position])
    generation = engine.generate(prompt, options, probes=Probes(readout_ranges=[(0, 600)]))
    [e async for e in generation]
    assert sorted(generation.prompt_readouts) == list(range(600))
    for position in (0, 127, 128, 300, 599):
        assert_readout_close(generation.prompt_readouts[position], want[position])


async def test_concurrent_requests_with_different_ranges(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    """Eight requests in flight at once: under pipelining the stages run different steps at the
    same moment, so fetches see one stage's rows before the other's."""

    every_ids = await check_concurrent_ranges(engine, tiny_reference, tiny_concepts, PROMPTS)
    for prompt, ids in zip(PROMPTS, every_ids, strict=True):
        assert ids[len(prompt) :] == tiny_reference.greedy(prompt, 8)


async def test_score_readouts(engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet) -> None:
    await check_score_readouts(engine, tiny_reference, tiny_concepts, PROMPTS[2])


async def test_steering_on_both_stages(engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet) -> None:
    """Each stage writes the coefficients of the layers it holds: layer 0 on stage 0, 3 on stage 1."""
    interventions = [
        steer("delta", 0, "add", -5.0, prompt=True, generated=True),
        steer("alpha", 3, "set", 3.0, ranges=((10, 40),)),
    ]
    generation, events = await run(engine, PROMPTS[1], interventions, GREEDY)
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[1], interventions, GREEDY, generation, events)


async def test_state_is_freed(engine: Engine) -> None:
    options = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def finish(i: int) -> None:
        [e async for e in engine.generate(PROMPTS[i % 8][:8], options, probes=Probes(readout_ranges=[(0, 100)]))]

    async def abandon(i: int) -> None:
        generation = engine.generate(
            PROMPTS[i % 8][:8], SamplingOptions(max_tokens=500), probes=Probes(readout_ranges=[(0, 900)])
        )
        await anext(generation)
        await generation.aclose()

    for start in range(0, 200, 50):
        await asyncio.gather(*(finish(i) for i in range(start, start + 40)), *(abandon(i) for i in range(10)))
    await asyncio.sleep(0.2)
    assert engine.num_unfinished_requests() == 0
    assert await engine.readouts.stored_in_worker() == 0
    assert engine.readouts.tracked() == 0
