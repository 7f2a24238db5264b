"""A failure in Salience's own per-step code (an op of the taps inside the compiled forward, the
worker's Python around it) fails the requests that asked for that work in that step, with an error
naming what failed, on core and on the wires; the other requests of the batch keep their exact
numbers and the engine keeps serving. The ops fail through the worker's test hook
(faults.FaultWorker.salience_test_fault), the worker's Python through malformed request tags."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable

import grpc
import pytest
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.output_streams import guarded
from salience.core.probes import readout_worker, steering_worker, tap_ops
from salience.core.probes.concepts import ConceptSet
from salience.errors import EngineError
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.inprocess import frontends
from tests.reference import Reference
from tests.steer_reference import check_against_reference
from tests.test_steering import GREEDY, PROMPTS, in_one_step, run, steer

KEEPS_SERVING = "this request failed; the server keeps serving"


@pytest.fixture(scope="module")
def engine(sae_engine_compiled: Engine) -> Engine:
    return sae_engine_compiled


@contextlib.asynccontextmanager
async def failing(engine: Engine, op: str, slot: int) -> AsyncIterator[None]:
    """Op `op` fails at `slot` in every step while the body runs."""
    await engine._rpc("salience_test_fault", (op, slot))
    try:
        yield
    finally:
        await engine._rpc("salience_test_fault", (None,))


async def failure(request: Awaitable) -> EngineError:
    with pytest.raises(EngineError) as caught:
        await request
    return caught.value


async def test_a_failed_steer_fails_the_request_steering_there_alone(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    interventions = [steer("beta", 2, "add", 6.0, prompt=True, generated=True)]
    async with failing(engine, "steer", engine.steering.layers.index(2)):
        failed, (generation, events) = await in_one_step(
            engine, [failure(run(engine, PROMPTS[1], interventions)), run(engine, PROMPTS[2], [])]
        )
    assert str(failed).startswith("salience::steer at layer 2 failed (RuntimeError: steer failed on purpose")
    assert str(failed).endswith(KEEPS_SERVING)
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[2], [], GREEDY, generation, events)
    # The engine serves on, the same steered request included: nothing of the failed step is reused.
    generation, events = await run(engine, PROMPTS[1], interventions)
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[1], interventions, GREEDY, generation, events)
    assert await engine.readouts.stored_in_worker() == 0


async def test_a_failed_readout_projection_fails_the_requests_reading_concepts(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    async with failing(engine, "readout_project", 0):
        failed, plain = await in_one_step(
            engine,
            [failure(run(engine, PROMPTS[3], [])), collected(engine.generate(PROMPTS[4], GREEDY))],
        )
    assert str(failed).startswith("salience::readout_project at layer 0 failed (RuntimeError:")
    logprobs = tiny_reference.logprobs(PROMPTS[4] + [e.token_id for e in plain]).float()
    assert [e.token_id for e in plain] == tiny_reference.greedy(PROMPTS[4], GREEDY.max_tokens)
    for event in plain:
        assert event.logprob == pytest.approx(float(logprobs[event.position - 1][event.token_id]), abs=1e-4)
    generation, events = await run(engine, PROMPTS[3], [])
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[3], [], GREEDY, generation, events)


async def collected(generation) -> list:
    return [e async for e in generation]


async def test_malformed_tags_fail_in_the_worker_their_requests_alone(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    """The worker's own per-step Python, fed what core never sends: each request's error is its own."""
    from vllm import SamplingParams

    async def submitted(extra: dict, request_id: str) -> None:
        params = SamplingParams(max_tokens=3, temperature=0.0, extra_args=extra)
        async for _ in guarded(engine.llm.generate({"prompt_token_ids": PROMPTS[5]}, params, request_id)):
            pass

    bad_steer = {steering_worker.TAG: [[1]]}
    bad_ranges = {readout_worker.TAG: ["bad-ranges", [[0]], [0]]}
    steered, read, (generation, events) = await in_one_step(
        engine,
        [
            failure(submitted(bad_steer, "bad-steer")),
            failure(submitted(bad_ranges, "bad-ranges")),
            run(engine, PROMPTS[6], []),
        ],
    )
    assert str(steered).startswith("reading the steering interventions failed (ValueError:")
    assert str(read).startswith(f"picking the rows {readout_worker.TAG} asks for failed (ValueError:")
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[6], [], GREEDY, generation, events)


async def test_on_the_wires_the_failed_request_gets_its_error_and_the_others_their_tokens(
    engine: Engine, tiny_reference: Reference
) -> None:
    prompt = PROMPTS[0]
    fields = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    features = ext.Features(sae="jump", k=5, ranges=[pb.PositionRange(start=0, end=1000)])
    async with frontends(engine) as served:
        client = await LmtpClient.connect(served.ws)
        channel = grpc.aio.insecure_channel(served.grpc_target)
        try:
            async with failing(engine, "readout_project", 1):
                with pytest.raises(LmtpStreamError) as lmtp:
                    _ = [p async for p in client.stream("GENERATE", **fields, readout=[[0, 1000]])]
            jump = next(served for served in engine.saes if served.name == "jump")
            async with failing(engine, "feature_store", jump.slot):
                opened = await salience_pb2_grpc.SalienceStub(channel).OpenSession(pb.OpenSessionRequest(model="tiny"))
                generate = pb.GenerateRequest(session_id=opened.session_id, append_tokens=prompt, max_tokens=3, top_k=1)
                request = ext.ExtendedGenerateRequest(generate=generate, features=features)
                with pytest.raises(grpc.aio.AioRpcError) as rpc:
                    _ = [e async for e in extensions_pb2_grpc.SalienceExtensionsStub(channel).ExtendedGenerate(request)]
            after = [p async for p in client.stream("GENERATE", **fields, readout=[[0, 1000]])]
        finally:
            await channel.close()
            await client.close()
    assert "salience::readout_project at layer 2 failed (RuntimeError:" in str(lmtp.value)
    assert KEEPS_SERVING in str(lmtp.value)
    assert rpc.value.code() == grpc.StatusCode.INTERNAL
    assert rpc.value.details().startswith("salience::feature_store at layer 3 failed (RuntimeError:")
    tokens = [p for p in after if not p.get("prompt")]
    logprobs = tiny_reference.logprobs(prompt + [p["token"] for p in tokens])
    assert [p["token"] for p in tokens] == tiny_reference.greedy(prompt, 4)
    for payload in tokens:
        assert payload["logprob"] == pytest.approx(float(logprobs[payload["position"] - 1][payload["token"]]), abs=1e-4)


def test_an_op_that_fails_records_it_and_returns() -> None:
    """A shape mismatch inside the projection (the GPT-NeoX bug that once stopped the engine) and
    inside the steering, called as the graph calls them: nothing raises, hidden is unchanged."""
    state, buffer = torch.ones(3, 8), torch.zeros(16, 2, 4)
    staging, matrices = torch.zeros(2, tap_ops.STAGED_ROWS, 6), torch.zeros(2, 4, 6)  # hidden 6, not 8
    hidden, directions = torch.ones(3, 8), torch.ones(5, 2)  # directions [hidden 5, K 2]
    coefficients = [torch.zeros(16, 1, 2)] * 2 + [torch.full((16, 1, 2), -torch.inf), torch.full((16, 1, 2), torch.inf)]
    tap_ops.Reading.columns, tap_ops.Steered.slots = 4, frozenset({0})
    try:
        tap_ops.readout_project(state, buffer, staging, matrices, 1, 0, 1)
        tap_ops.steer(hidden, None, directions, *coefficients, 0)
        raised, tap_ops.Faults.raised = tap_ops.Faults.raised, []
    finally:
        tap_ops.Reading.columns, tap_ops.Steered.slots = 0, frozenset()
    assert [(op, slot, type(exc)) for op, slot, exc in raised] == [
        ("readout_project", 1, RuntimeError),
        ("steer", 0, RuntimeError),
    ]
    assert torch.equal(hidden, torch.ones(3, 8))
