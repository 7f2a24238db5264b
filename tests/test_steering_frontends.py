"""Steering on the wire: LMTP's `steer` field and gRPC's SteeredGenerate, against the core engine."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.probes.steering import Intervention, Op
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS
from tests.inprocess import Frontends, frontends

PROMPT = [0, *range(100, 130)]
FRENCH_LIKE = {"direction": "beta", "layers": [2], "op": "add", "value": 6.0, "positions": "all"}
CORE = Intervention(direction="beta", layers=(2,), op=Op.ADD, value=6.0, prompt=True, generated=True)


@pytest.fixture(scope="module")
def engine(read_engine: Engine) -> Engine:
    return read_engine


@pytest_asyncio.fixture(scope="module")
async def served(engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(engine) as served:
        yield served


@pytest_asyncio.fixture
async def lmtp(served: Frontends) -> AsyncIterator[LmtpClient]:
    client = await LmtpClient.connect(served.ws)
    yield client
    await client.close()


def close(got, want) -> None:
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


async def direct(engine: Engine, prompt, n: int, steer=(CORE,)):
    options = SamplingOptions(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
    generation = engine.generate(prompt, options, probes=Probes(readout_ranges=[(0, 1000)], steer=steer))
    events = [e async for e in generation]
    assert len(events) == n and sorted(generation.prompt_readouts) == list(range(len(prompt)))
    return generation, events


async def test_lmtp_generate_score_and_session_are_steered(engine: Engine, lmtp: LmtpClient) -> None:
    info = (await lmtp.request("MODEL_INFO"))["model_info"]["steering"]
    assert info["directions"] == {name: list(TINY_LAYERS) for name in TINY_CONCEPTS}
    assert info["max_interventions"] == 16

    generation, events = await direct(engine, PROMPT, 6)
    fields = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "top_logprobs": 2}
    payloads = [p async for p in lmtp.stream("GENERATE", **fields, readout=[[0, 1000]], steer=[FRENCH_LIKE])]
    decoded = [p for p in payloads if not p.get("prompt")]
    assert [p["token"] for p in decoded] == [e.token_id for e in events]
    assert [p["logprob"] for p in decoded] == pytest.approx([e.logprob for e in events], abs=1e-6)
    close([p["readout"] for p in decoded], [e.readout for e in events])
    prompt_rows = {p["position"]: p["readout"] for p in payloads if p.get("prompt")}
    assert sorted(prompt_rows) == sorted(generation.prompt_readouts)
    close([prompt_rows[p] for p in sorted(prompt_rows)], [generation.prompt_readouts[p] for p in sorted(prompt_rows)])
    plain = [p async for p in lmtp.stream("GENERATE", **fields)]
    assert [p["logprob"] for p in plain] != pytest.approx([p["logprob"] for p in decoded], abs=1e-3)

    # SCORE: `all` covers the scored tokens as if generated, so it gives the generation's logprobs.
    continuation = [e.token_id for e in events]
    scored = [p async for p in lmtp.stream("SCORE", prompt=PROMPT, scored=continuation, steer=[FRENCH_LIKE])]
    assert [p["logprob"] for p in scored] == pytest.approx([e.logprob for e in events], abs=1e-5)

    # A session turn states its own interventions; the next, unsteered, turn is not steered.
    opened = await lmtp.request("OPEN_SESSION")
    turn = {"session_id": opened["session_id"], "offset": 0, "append": PROMPT, "max_tokens": 6, "temperature": 0}
    first = [p async for p in lmtp.stream("SESSION_GENERATE", **turn, logprobs=[[31, 37]], steer=[FRENCH_LIKE])]
    tokens = [p["token"] for p in first if "token" in p]
    assert tokens == continuation
    assert [p["logprob"] for p in first if "token" in p] == pytest.approx([e.logprob for e in events], abs=1e-5)
    rescored = {**turn, "offset": len(PROMPT) + 6, "append": [], "max_tokens": 0, "logprobs": [[31, 37]]}
    unsteered = [p async for p in lmtp.stream("SESSION_GENERATE", **rescored)]
    want = await engine.score(PROMPT, continuation)
    assert [p["logprob"] for p in unsteered if "token" in p] == pytest.approx([t.logprob for t in want], abs=1e-5)


WIRE_ERRORS = [
    ({"direction": "zeta", "layers": [2]}, "steer[0]: unknown direction 'zeta'"),
    ({"direction": "beta", "layers": [1]}, "steer[0]: direction 'beta' has no vector at layer 1"),
    ({"direction": "beta", "layers": [9]}, "steer[0]: layer 9 is not a layer of this model (0..3)"),
    ({"direction": "beta", "layers": [2], "value": 1e300}, "steer[0]: |value| must be at most 10000"),
    ({"direction": "beta", "layers": [2], "op": "ablate", "value": 1}, "steer[0]: ablate takes no value"),
    ({"direction": "beta", "layers": [2], "positions": [[4, 4]]}, "steer[0]: range 0 must satisfy 0 <= start < end"),
    ({"direction": "beta", "layers": [2], "positions": []}, "steer[0]: names no positions"),
]


@pytest.mark.parametrize(("intervention", "message"), WIRE_ERRORS)
@pytest.mark.parametrize("kind", ["GENERATE", "SCORE", "SESSION_GENERATE"])
async def test_lmtp_stream_errors(engine: Engine, lmtp: LmtpClient, kind: str, intervention: dict, message: str):
    fields = {
        "GENERATE": {"prompt": PROMPT},
        "SCORE": {"prompt": PROMPT[:5], "scored": PROMPT[5:]},
        "SESSION_GENERATE": {"offset": 0, "append": PROMPT, "max_tokens": 2},
    }[kind]
    if kind == "SESSION_GENERATE":
        fields["session_id"] = (await lmtp.request("OPEN_SESSION"))["session_id"]
    with pytest.raises(LmtpStreamError, match=re.escape(message)):
        [p async for p in lmtp.stream(kind, **fields, steer=[intervention])]
    with pytest.raises(LmtpStreamError, match="at most 16 are allowed"):
        [p async for p in lmtp.stream(kind, **fields, steer=[FRENCH_LIKE] * 17)]
    assert engine.num_unfinished_requests() == 0


async def test_grpc_steered_generate_and_the_thick_client(engine: Engine, served: Frontends) -> None:
    generation, events = await direct(engine, PROMPT, 5)
    async with AsyncSalienceClient(served.grpc_target) as client:
        manifest = await client.steering_manifest()
        assert [(d.name, list(d.layers)) for d in manifest.directions] == [
            (n, list(TINY_LAYERS)) for n in TINY_CONCEPTS
        ]
        assert manifest.max_interventions == 16 and manifest.max_magnitude == 1e4
        for steer in ([FRENCH_LIKE], [CORE]):  # the JSON form, or core Interventions
            session = await client.open_session("tiny")
            result = await session.generate(
                PROMPT, max_tokens=5, top_k=1, logprobs_ranges=[(1, None)], readout_ranges=[(0, None)], steer=steer
            )
            assert result.token_ids == [e.token_id for e in events]
            assert [t.sampled_logprob for t in result.tokens] == pytest.approx([e.logprob for e in events], abs=1e-5)
            close([list(t.readout) for t in result.tokens], [e.readout for e in events])
            assert [t.position for t in result.prefill] == list(range(len(PROMPT)))
            close(
                [list(t.readout) for t in result.prefill], [generation.prompt_readouts[p] for p in range(len(PROMPT))]
            )
            assert session.length == len(PROMPT) + 5
            plain = await session.generate([7], max_tokens=2, top_k=1)  # the seed's Generate, on the same session
            assert plain.done.completion_tokens == 2
            await session.close()

        session = await client.open_session("tiny")
        for steer, message in (
            ([{"direction": "zeta", "layers": [2], "positions": "all"}], "steer[0]: unknown direction 'zeta'"),
            ([{"direction": "beta", "layers": [2], "value": float("nan")}], "value must be a finite number"),
            ([FRENCH_LIKE] * 17, "at most 16 are allowed"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await session.generate(PROMPT, max_tokens=2, top_k=1, steer=steer)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in info.value.details()
        assert await session.dump() == []  # refused before the session changed
    assert engine.num_unfinished_requests() == 0


async def test_grpc_an_unspecified_op_is_refused(engine: Engine, served: Frontends) -> None:
    """A raw client that leaves `op` unset (OP_UNSPECIFIED, proto3's zero) is refused, not read as add."""
    async with grpc.aio.insecure_channel(served.grpc_target) as channel:
        seed = salience_pb2_grpc.SalienceStub(channel)
        session_id = (await seed.OpenSession(pb.OpenSessionRequest(model="tiny"))).session_id
        request = ext.SteeredGenerateRequest(
            generate=pb.GenerateRequest(session_id=session_id, append_tokens=PROMPT, max_tokens=2),
            interventions=[ext.Intervention(direction="beta", layers=[2], value=6.0, generated=True)],
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [e async for e in extensions_pb2_grpc.SalienceExtensionsStub(channel).SteeredGenerate(request)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("steer[0]: op must be OP_ADD, OP_SET, OP_ABLATE or OP_CAP (request_id=")
        dumped = await seed.DumpSession(pb.DumpSessionRequest(session_id=session_id))
        assert list(dumped.tokens) == []
    assert engine.num_unfinished_requests() == 0
