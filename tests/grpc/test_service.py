"""Every RPC of salience.v1 over a real channel, against the core and a transformers reference."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from salience.core.serving.sessions import SessionLimits
from salience.grpc_frontend.client import AsyncSalienceClient, SalienceClient
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS
from tests.engines import settled
from tests.grpc.conftest import MODEL, Served, ServerFactory
from tests.reference import Reference, assert_readout_close, reference_readouts

PROMPT = [0, *range(100, 140)]
Done = pb.GenerateDone


def stub(target: str) -> salience_pb2_grpc.SalienceStub:
    return salience_pb2_grpc.SalienceStub(grpc.aio.insecure_channel(target))


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        result = call
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    return info.value.code(), info.value.details()


async def test_open_session_checks_the_model_and_reports_max_model_len(client: AsyncSalienceClient) -> None:
    session = await client.open_session(MODEL)
    assert client.max_model_len == 1024 and session.length == 0
    await client.open_session("tiny-alias")
    code, details = await status_of(client.open_session("llama-70b"))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and "'llama-70b' is not served here" in details


async def test_greedy_generation_matches_reference_and_dump(client: AsyncSalienceClient, tiny_reference: Reference):
    session = await client.open_session(MODEL)
    result = await session.generate(PROMPT, max_tokens=8, top_k=1)  # temperature 0 means 1.0: greedy is top_k=1
    assert result.token_ids == tiny_reference.greedy(PROMPT, 8)
    assert [t.position for t in result.tokens] == list(range(41, 49))
    assert not any(t.is_prefill or t.has_sampled_logprob or t.readout for t in result.tokens)
    assert (result.done.prompt_tokens, result.done.completion_tokens, result.done.total_tokens) == (41, 8, 49)
    assert result.done.finish_reason == Done.FINISH_REASON_LENGTH
    assert session.length == 49
    assert await session.dump() == PROMPT + result.token_ids

    # Only the delta goes over the wire; the next turn continues the same list.
    more = await session.generate([5, 6], max_tokens=3, top_k=1)
    assert more.token_ids == tiny_reference.greedy(PROMPT + result.token_ids + [5, 6], 3)
    assert session.length == 54


async def test_prefill_only_scoring_matches_the_core(served: Served, client: AsyncSalienceClient) -> None:
    session = await client.open_session(MODEL)
    result = await session.generate(PROMPT, logprobs_ranges=[(0, len(PROMPT))], logprob_top_k=3)
    assert result.tokens == [] and result.done.completion_tokens == 0
    assert [t.position for t in result.prefill] == list(range(len(PROMPT)))
    assert not result.prefill[0].has_sampled_logprob  # nothing before it
    scored = await served.engine.score(PROMPT[:1], PROMPT[1:], top_logprobs=3)
    for token, want in zip(result.prefill[1:], scored, strict=True):
        assert token.id == want.token_id and token.has_sampled_logprob
        assert token.sampled_logprob == pytest.approx(want.logprob, abs=1e-6)
        assert [(a.id, pytest.approx(a.logprob, abs=1e-6)) for a in token.logprobs] == list(want.top_logprobs)


async def test_readouts_and_decode_logprobs(
    served: Served, client: AsyncSalienceClient, tiny_reference: Reference, tiny_concepts
) -> None:
    manifest = await client.readout_manifest()
    assert list(manifest.concepts) == list(TINY_CONCEPTS) and list(manifest.layers) == list(TINY_LAYERS)
    assert (manifest.hidden_size, manifest.dtype) == (128, "float32")
    session = await client.open_session(MODEL)
    covered = [(38, 45)]
    result = await session.generate(
        PROMPT, max_tokens=4, top_k=1, readout_ranges=covered, logprobs_ranges=covered, logprob_top_k=2
    )
    assert [(t.position, t.is_prefill) for t in result.prefill + result.tokens] == [(p, p < 41) for p in range(38, 45)]
    ids = await session.dump()
    core = await served.engine.readout(ids, covered)
    want = reference_readouts(tiny_reference, tiny_concepts, ids)
    logprobs = tiny_reference.logprobs(ids)
    for token in result.prefill + result.tokens:
        assert len(token.readout) == len(TINY_LAYERS) * len(TINY_CONCEPTS)
        assert list(token.readout) == pytest.approx(core[token.position], rel=1e-5, abs=1e-5)
        assert_readout_close(list(token.readout), want[token.position])
        assert token.has_sampled_logprob and len(token.logprobs) == 2
        assert token.sampled_logprob == pytest.approx(logprobs[token.position - 1, token.id].item(), abs=1e-4)


async def test_status_codes(served: Served, client: AsyncSalienceClient) -> None:
    rpc = stub(served.target)
    session = await client.open_session(MODEL)
    await session.generate(PROMPT)
    sid = session.id

    def generate(**fields) -> pb.GenerateRequest:
        return rpc.Generate(pb.GenerateRequest(**({"session_id": sid, "offset": len(PROMPT)} | fields)))

    cases = [
        (rpc.DumpSession(pb.DumpSessionRequest(session_id="nope")), grpc.StatusCode.NOT_FOUND, "no session 'nope'"),
        (generate(offset=3), grpc.StatusCode.FAILED_PRECONDITION, "offset 3 does not match the session's length 41"),
        (generate(max_tokens=1000), grpc.StatusCode.RESOURCE_EXHAUSTED, "exceed the model's context of 1024"),
        (
            generate(readout_ranges=[pb.PositionRange(start=5, end=2)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "readout_ranges[0]",
        ),
        (generate(append_tokens=[10**6]), grpc.StatusCode.INVALID_ARGUMENT, "append_tokens[0] = 1000000"),
        (
            generate(logprobs_ranges=[pb.PositionRange(start=1, end=5)], logprob_top_k=21),
            grpc.StatusCode.INVALID_ARGUMENT,
            "top logprobs must be an integer in 0..20",
        ),
        (
            generate(
                images=[pb.ImageAttachment(bytes=b"\x89PNG", mime="image/png", pad_range_start=0, pad_range_end=3)]
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "takes no images",
        ),
        (
            rpc.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=50)),
            grpc.StatusCode.FAILED_PRECONDITION,
            "fork at position 50: the session has 41 tokens",
        ),
    ]
    for call, code, message in cases:
        got = await status_of(call)
        assert got[0] is code and message in got[1], (code, got)
    assert await session.dump() == PROMPT  # nothing above changed it

    busy = rpc.Generate(pb.GenerateRequest(session_id=sid, offset=len(PROMPT), max_tokens=400, top_k=1))
    await anext(busy.__aiter__())
    code, details = await status_of(generate())
    assert code is grpc.StatusCode.ABORTED and "already generating" in details
    busy.cancel()


async def test_unavailable_while_loading() -> None:
    from salience.core.serving.sessions import SessionStore
    from salience.core.serving.status import ServerStatus
    from salience.grpc_frontend.server import start_grpc_server

    status = ServerStatus(MODEL)
    server = await start_grpc_server(status, SessionStore(status.serving_engine), "127.0.0.1", 0)
    try:
        code, details = await status_of(
            stub(f"127.0.0.1:{server.port}").OpenSession(pb.OpenSessionRequest(model=MODEL))
        )
        assert code is grpc.StatusCode.UNAVAILABLE and "still loading" in details
    finally:
        await server.stop(0)


async def test_stop_tokens_end_with_eos(client: AsyncSalienceClient, tiny_reference: Reference) -> None:
    greedy = tiny_reference.greedy(PROMPT, 6)
    session = await client.open_session(MODEL)
    result = await session.generate(PROMPT, max_tokens=6, top_k=1, stop_token_ids=[greedy[2]], priority=10)
    assert result.token_ids == greedy[: greedy.index(greedy[2]) + 1]
    assert result.done.finish_reason == Done.FINISH_REASON_EOS


async def test_sixteen_sessions_at_once(client: AsyncSalienceClient, tiny_reference: Reference) -> None:
    prompts = [[0, *range(200 + 7 * i, 230 + 7 * i)] for i in range(16)]
    sessions = [await client.open_session(MODEL) for _ in prompts]
    results = await asyncio.gather(
        *(s.generate(p, max_tokens=6, top_k=1) for s, p in zip(sessions, prompts, strict=True))
    )
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == tiny_reference.greedy(prompt, 6)


async def test_fork_then_diverge(client: AsyncSalienceClient, tiny_reference: Reference) -> None:
    session = await client.open_session(MODEL)
    await session.generate(PROMPT, max_tokens=4, top_k=1)
    branch = await session.fork(len(PROMPT))
    assert branch.length == len(PROMPT) and await branch.dump() == PROMPT
    other = await branch.generate([7, 8, 9], max_tokens=3, top_k=1)
    assert other.token_ids == tiny_reference.greedy([*PROMPT, 7, 8, 9], 3)
    assert len(await session.dump()) == 45 and session.length == 45
    # The source may rewind on purpose; the client sends truncating for it.
    again = await session.generate([1], truncate_to=10, max_tokens=2, top_k=1)
    assert await session.dump() == [*PROMPT[:10], 1, *again.token_ids]


async def test_cancel_mid_stream_aborts_and_keeps_the_session(served: Served, client: AsyncSalienceClient) -> None:
    session = await client.open_session(MODEL)
    seen = 0
    async for _event in session.stream(PROMPT, max_tokens=500, top_k=1):
        seen += 1
        if seen == 3:
            break  # cancels the call
    assert await settled(served.engine) == 0
    # The session kept what was streamed (perhaps a token or two more); the client resyncs once.
    result = await session.generate([3], max_tokens=2, top_k=1)
    assert len(await session.dump()) == session.length >= len(PROMPT) + 3 + 1 + 2
    assert result.done.completion_tokens == 2


async def test_close_during_generate_ends_with_cancelled(client: AsyncSalienceClient) -> None:
    session = await client.open_session(MODEL)
    events = []
    async for event in session.stream(PROMPT, max_tokens=500, top_k=1):
        events.append(event)
        if len(events) == 2:
            await session.close()
    assert events[-1].done.finish_reason == Done.FINISH_REASON_CANCELLED
    await session.close()  # idempotent
    code, _ = await status_of(session.dump())
    assert code is grpc.StatusCode.NOT_FOUND


async def test_idle_sessions_expire(serve_grpc: ServerFactory) -> None:
    async with serve_grpc(SessionLimits(ttl=0.3)) as short, AsyncSalienceClient(short.target) as client:
        kept, dropped = await client.open_session(MODEL), await client.open_session(MODEL)
        for _ in range(3):
            await asyncio.sleep(0.15)
            await kept.generate()  # the no-op Generate refreshes the TTL
        code, details = await status_of(dropped.generate())
        assert code is grpc.StatusCode.NOT_FOUND and "evicted after idling" in details
        assert await kept.dump() == []


async def test_session_limits_are_resource_exhausted(serve_grpc: ServerFactory) -> None:
    async with serve_grpc(SessionLimits(max_sessions=1)) as small, AsyncSalienceClient(small.target) as client:
        busy = await client.open_session(MODEL)
        stream = busy.stream(PROMPT, max_tokens=300, top_k=1)
        await anext(stream)
        code, details = await status_of(client.open_session(MODEL))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "1 of 1 sessions" in details
        await stream.aclose()


async def test_bearer_token(serve_grpc: ServerFactory) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with serve_grpc(token="s3cret") as locked:
        for token in (None, "wrong"):
            async with AsyncSalienceClient(locked.target, token=token) as client:
                code, details = await status_of(client.open_session(MODEL))
                assert code is grpc.StatusCode.UNAUTHENTICATED and "bearer token" in details
                code, _ = await status_of(stub(locked.target).Generate(pb.GenerateRequest(session_id="x")))
                assert code is grpc.StatusCode.UNAUTHENTICATED
        async with AsyncSalienceClient(locked.target, token="s3cret") as client:
            session = await client.open_session(MODEL)
            assert (await session.generate([1, 2], max_tokens=2, top_k=1)).done.completion_tokens == 2
        # Load balancers probe health without credentials.
        health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(locked.target))
        reply = await health.Check(health_pb2.HealthCheckRequest(service="salience.v1.Salience"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_service(served: Served) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflection = reflection_pb2_grpc.ServerReflectionStub(grpc.aio.insecure_channel(served.target))
    call = reflection.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert {"salience.v1.Salience", "grpc.health.v1.Health"} <= names


async def test_sync_client(served: Served, tiny_reference: Reference) -> None:
    def work() -> list[int]:
        with SalienceClient(served.target) as client:
            session = client.open_session(MODEL)
            first = session.generate(PROMPT, max_tokens=3, top_k=1)
            branch = session.fork(len(PROMPT))
            tail = branch.generate([4], max_tokens=1, top_k=1, logprobs_ranges=[(len(PROMPT), None)])
            assert [(t.position, t.is_prefill) for t in tail.prefill + tail.tokens] == [
                (len(PROMPT), True),
                (len(PROMPT) + 1, False),
            ]
            assert branch.length == len(PROMPT) + 2 == len(branch.dump())
            session.close()
            return first.token_ids

    assert await asyncio.to_thread(work) == tiny_reference.greedy(PROMPT, 3)
