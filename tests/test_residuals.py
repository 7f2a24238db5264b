"""Raw residual rows with a request, on the tiny model: prompt and decoded positions, beside other
requests, across a prefix-cache hit, against transformers float32 (the layer's output, before the
final norm)."""

from __future__ import annotations

import asyncio
import base64

import grpc
import numpy as np
import pytest

from salience.core.engine.engine import Engine
from salience.core.engine.generation import Generation
from salience.core.engine.requests import FinishReason, Probes, ResidualRequest, SamplingOptions, TokenEvent
from salience.core.engine.row_budget import RowBudget
from salience.core.engine.rows import layer_names, residual_plan
from salience.core.models.points import Point
from salience.errors import InvalidArgument
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.inprocess import frontends
from tests.reference import Reference, check_rows_across_a_cache_hit

PROMPTS = [[0, *range(60 + 13 * i, 84 + 13 * i)] for i in range(6)]
GREEDY = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(read_engine_each_mode: Engine) -> Engine:
    return read_engine_each_mode


def assert_rows(
    rows: dict[int, np.ndarray],
    reference: Reference,
    ids: list[int],
    layers: tuple[int, ...],
    point: Point = "resid_post",
) -> None:
    """Each position's rows are the reference's stream at `point` (the concept set's) of `layers`."""
    want = reference.residuals(ids, layers, point)
    for position, row in rows.items():
        assert row.shape == (len(layers), 128) and row.dtype == np.float32
        for i, layer in enumerate(layers):
            expected = want[layer][position].numpy()
            error = np.abs(row[i] - expected).max() / np.abs(expected).max()
            assert error < 1e-4, (position, layer, error)


async def collect(generation: Generation) -> list[TokenEvent]:
    async with generation:
        return [e async for e in generation]


async def generate(engine: Engine, prompt: list[int], residual: ResidualRequest | None, **kwargs):
    generation = engine.generate(prompt, GREEDY, probes=Probes(residual=residual, **kwargs))
    events = [e async for e in generation]
    return generation, events


async def test_prompt_and_decoded_rows_equal_the_reference(engine: Engine, tiny_reference: Reference) -> None:
    prompt = PROMPTS[0]
    residual = ResidualRequest(layers=(3, 0), ranges=((2, 6), (len(prompt) - 1, 1000)))
    generation, events = await generate(engine, prompt, residual)
    assert len(events) == GREEDY.max_tokens
    ids = prompt + [e.token_id for e in events]
    assert sorted(generation.prompt_residuals) == [2, 3, 4, 5, len(prompt) - 1]
    assert all(e.residual is not None and e.readout is None for e in events)  # the last one's too
    rows = {**generation.prompt_residuals, **{e.position: e.residual for e in events}}
    assert_rows(rows, tiny_reference, ids, (3, 0))
    # Readouts beside them are unchanged.
    _, again = await generate(engine, prompt, residual, readout_ranges=[(0, 1000)])
    assert [e.token_id for e in again] == [e.token_id for e in events]
    assert all(e.readout is not None and e.residual is not None for e in again)


async def test_concurrent_requests_get_exactly_their_rows(engine: Engine, tiny_reference: Reference) -> None:
    asks = [
        ResidualRequest(layers=(0,), ranges=((0, 5),)),
        None,
        ResidualRequest(layers=(2, 3), ranges=((len(PROMPTS[2]), 1000),)),
        ResidualRequest(layers=(3,), ranges=((10, 12), (len(PROMPTS[3]) + 2, len(PROMPTS[3]) + 4))),
        None,
        ResidualRequest(layers=(0, 2, 3), ranges=((0, 1000),)),
    ]
    results = await asyncio.gather(*(generate(engine, p, r) for p, r in zip(PROMPTS, asks, strict=True)))
    for prompt, ask, (generation, events) in zip(PROMPTS, asks, results, strict=True):
        assert len(events) == GREEDY.max_tokens
        rows = {**generation.prompt_residuals, **{e.position: e.residual for e in events if e.residual is not None}}
        if ask is None:
            assert rows == {}
            continue
        total = len(prompt) + GREEDY.max_tokens
        assert sorted(rows) == [p for p in range(total) if any(s <= p < e for s, e in ask.ranges)]
        assert_rows(rows, tiny_reference, prompt + [e.token_id for e in events], ask.layers)
    assert engine.readouts.tracked() == 0


async def test_a_prefix_cache_hit_still_computes_the_rows(engine: Engine, tiny_reference: Reference) -> None:
    await check_rows_across_a_cache_hit(
        engine,
        "residual",
        lambda start: Probes(residual=ResidualRequest(layers=(0, 3), ranges=((start, 1000),))),
        lambda rows, ids: assert_rows(rows, tiny_reference, ids, (0, 3)),
    )


def test_a_refused_layer_names_the_read_layers_not_a_range_that_holds_it() -> None:
    assert [layer_names(r) for r in ([0, 2, 3], list(range(30)), [0, 1], [5, 0, 1, 2, 7])] == [
        "0, 2, 3",
        "0..29",
        "0, 1",
        "0..2, 5, 7",
    ]
    with pytest.raises(InvalidArgument, match=r"layer 1 is not read; residual rows come from the read layers 0, 2, 3$"):
        residual_plan(
            ResidualRequest(layers=(1,), ranges=((0, 4),)), 10, read=(0, 2, 3), slots=(0, 1, 2), hidden=128, limit=100
        )


async def test_bad_residual_requests_are_refused_before_anything_runs(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = PROMPTS[5]
    cases = [
        (ResidualRequest(layers=(1,), ranges=((0, 4),)), r"residual layer 1 is not read; .* the read layers 0, 2, 3$"),
        (ResidualRequest(layers=(), ranges=((0, 4),)), "one or more distinct layers"),
        (ResidualRequest(layers=(2, 2), ranges=((0, 4),)), "one or more distinct layers"),
        (ResidualRequest(layers=(2,), ranges=()), "names no positions"),
        (ResidualRequest(layers=(2,), ranges=((5, 3),)), "0 <= start < end"),
    ]
    for residual, words in cases:
        with pytest.raises(InvalidArgument, match=words):
            engine.generate(prompt, GREEDY, probes=Probes(residual=residual))
    assert engine.settings.max_residual_rows == 16384  # beyond the tiny model's context: lowered here
    monkeypatch.setattr(engine.settings, "max_residual_rows", 100)
    many = ResidualRequest(layers=(0, 2, 3), ranges=((0, 1000),))
    with pytest.raises(InvalidArgument, match=r"asks for 35 positions x 3 layers; at most 100 rows per request"):
        engine.generate(prompt, SamplingOptions(max_tokens=10), probes=Probes(residual=many))
    monkeypatch.setattr(engine, "row_budget", RowBudget(90, 4 * 128))
    with pytest.raises(InvalidArgument, match=r"32 positions x 3 layers; this server holds at most 90 residual rows"):
        await engine.prefill(prompt + prompt[:7], probes=Probes(residual=many))  # 96 rows: within the request limit
    assert engine.num_unfinished_requests() == 0


async def test_requests_beyond_the_residual_budget_wait_their_turn(
    engine: Engine, tiny_reference: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The budget holds two of these requests at once: the others queue, in order, and run when rows
    are given back; a queued generation cancelled never reaches vLLM; a request without residual
    rows never waits."""
    if engine.compiled:
        pytest.skip("admission is the same for both graphs")
    budget = RowBudget(2 * 25 * 2, 4 * 128)
    monkeypatch.setattr(engine, "row_budget", budget)
    residual = ResidualRequest(layers=(0, 3), ranges=((0, 1000),))
    prompts = PROMPTS[:4]
    passes = [asyncio.create_task(engine.prefill(prompt, probes=Probes(residual=residual))) for prompt in prompts]
    await asyncio.sleep(0)  # each pass reserves its rows, in order
    queued = engine.generate(PROMPTS[4], GREEDY, probes=Probes(residual=ResidualRequest(layers=(2,), ranges=((0, 1),))))
    consumer = asyncio.create_task(collect(queued))
    await asyncio.sleep(0)
    assert budget.held == 100 and budget.waiting == 3
    await queued.cancel()
    assert budget.waiting == 2
    assert await consumer == [] and queued.finish_reason is FinishReason.CANCELLED
    plain = await collect(engine.generate(PROMPTS[5], GREEDY))  # asks for no rows: never waits
    assert len(plain) == GREEDY.max_tokens
    for prompt, scores in zip(prompts, await asyncio.gather(*passes), strict=True):
        assert sorted(scores.residuals) == list(range(len(prompt)))
        assert_rows(scores.residuals, tiny_reference, prompt, (0, 3))
    assert budget.held == 0 and budget.waiting == 0
    assert engine.num_unfinished_requests() == 0


async def test_lmtp_carries_the_rows_as_base64_float32(engine: Engine, tiny_reference: Reference) -> None:
    if engine.compiled:
        pytest.skip("the wire is the same for both graphs")
    prompt = PROMPTS[1]
    fields = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    async with frontends(engine) as served:
        client = await LmtpClient.connect(served.ws)
        try:
            residual = {"layers": [2], "ranges": [[len(prompt) - 2, 1000]]}
            payloads = [p async for p in client.stream("GENERATE", **fields, residual=residual)]
            scored = [p async for p in client.stream("SCORE", prompt=prompt[:5], scored=prompt[5:], residual=residual)]
            with pytest.raises(LmtpStreamError, match="residual layer 1 is not read"):
                _ = [p async for p in client.stream("GENERATE", **fields, residual={"layers": [1], "ranges": [[0, 3]]})]
            with pytest.raises(LmtpStreamError, match="residual must be"):
                _ = [p async for p in client.stream("GENERATE", **fields, residual=[2])]
        finally:
            await client.close()
    rows = {
        p["position"]: np.frombuffer(base64.b64decode(p["residual"]), dtype="<f4").reshape(1, 128) for p in payloads
    }
    assert sorted(rows) == list(range(len(prompt) - 2, len(prompt) + 4))
    assert_rows(rows, tiny_reference, prompt + [p["token"] for p in payloads if not p.get("prompt")], (2,))
    assert [p["position"] for p in scored if "residual" in p] == list(range(len(prompt) - 2, len(prompt)))


async def test_session_turns_carry_rows_over_lmtp_and_grpc(engine: Engine, tiny_reference: Reference) -> None:
    if engine.compiled:
        pytest.skip("the wire is the same for both graphs")
    prompt = PROMPTS[2]
    end = len(prompt) + 3
    async with frontends(engine) as served:
        client = await LmtpClient.connect(served.ws)
        try:
            session = (await client.request("OPEN_SESSION"))["session_id"]
            fields = {"session_id": session, "offset": 0, "append": prompt, "max_tokens": 3, "top_k": 1}
            residual = {"layers": [0, 3], "ranges": [[len(prompt) - 3, end]]}
            payloads = [p async for p in client.stream("SESSION_GENERATE", **fields, residual=residual)]
        finally:
            await client.close()
        lmtp_rows = {
            p["position"]: np.frombuffer(base64.b64decode(p["residual"]), dtype="<f4").reshape(2, 128)
            for p in payloads
            if "residual" in p
        }
        ids = prompt + [p["token"] for p in payloads if "token" in p and not p.get("prompt")]
        assert sorted(lmtp_rows) == list(range(len(prompt) - 3, end))
        assert_rows(lmtp_rows, tiny_reference, ids, (0, 3))

        channel = grpc.aio.insecure_channel(served.grpc_target)
        try:
            seed = salience_pb2_grpc.SalienceStub(channel)
            extensions = extensions_pb2_grpc.SalienceExtensionsStub(channel)
            opened = await seed.OpenSession(pb.OpenSessionRequest(model="tiny"))
            request = ext.ExtendedGenerateRequest(
                generate=pb.GenerateRequest(session_id=opened.session_id, append_tokens=prompt, max_tokens=3, top_k=1),
                residual=ext.Residual(layers=[2], ranges=[pb.PositionRange(start=0, end=end)]),
            )
            events = [e async for e in extensions.ExtendedGenerate(request)]
        finally:
            await channel.close()
    grpc_rows = {
        e.event.token.position: np.frombuffer(e.residual, dtype="<f4").reshape(1, 128)
        for e in events
        if e.event.HasField("token")
    }
    assert sorted(grpc_rows) == list(range(end))
    assert_rows(grpc_rows, tiny_reference, ids, (2,))
