"""Live concepts on the wire: LMTP's DEFINE_CONCEPT, DELETE_CONCEPT and SAVE_CONCEPTS, gRPC's
extension RPCs, the operator token, and request vectors over both."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.steering import Intervention, Op
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.lmtp.session import LmtpConfig
from tests.conftest import TINY_CONCEPTS, TINY_LAYERS, drop_live_concepts
from tests.inprocess import Frontends, frontends

PROMPT = [0, *range(100, 130)]
ACCESS, OPERATOR = "access-token", "operator-token"


@pytest.fixture(scope="module")
def engine(read_engine: Engine) -> Engine:
    return read_engine


@pytest_asyncio.fixture(scope="module")
async def served(engine: Engine) -> AsyncIterator[Frontends]:
    config = LmtpConfig(tokens=Tokens(ACCESS, OPERATOR))
    async with frontends(engine, lmtp=config, grpc_tokens=Tokens(ACCESS, OPERATOR)) as served:
        yield served


@pytest_asyncio.fixture(autouse=True)
async def no_live_concepts_left(engine: Engine) -> AsyncIterator[None]:
    yield
    await drop_live_concepts(engine)


async def connect(served: Frontends, token: str) -> LmtpClient:
    return await LmtpClient.connect(served.ws, {"Authorization": f"Bearer {token}"})


def vector(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(128).astype(np.float32)


async def direct(engine: Engine, steer=()) -> list:
    """The engine's own 6 tokens after PROMPT (31 tokens), each read out."""
    options = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
    events = [e async for e in engine.generate(PROMPT, options, probes=Probes(readout_ranges=[(31, 40)], steer=steer))]
    assert [e.position for e in events] == list(range(31, 37))
    return events


async def test_lmtp_defines_reads_steers_and_deletes_a_concept(engine: Engine, served: Frontends) -> None:
    operator = await connect(served, OPERATOR)
    try:
        before = (await operator.request("MODEL_INFO"))["model_info"]
        reply = await operator.request("DEFINE_CONCEPT", name="zeta", vector=vector(1).tolist())
        assert reply["concept"] == "zeta" and reply["version"] == before["readout_manifest"]["version"] + 1
        assert "not validated" in reply["table"]
        info = (await operator.request("MODEL_INFO"))["model_info"]
        manifest = info["readout_manifest"]
        assert manifest["concepts"] == [*TINY_CONCEPTS, "zeta"] and manifest["live"] == ["zeta"]
        assert manifest["concept_info"][-1] == {"name": "zeta", "live": True}
        assert info["steering"]["directions"]["zeta"] == list(TINY_LAYERS)
        steer = {"direction": "zeta", "layers": [2], "op": "add", "value": 5.0, "positions": "all"}
        fields = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "readout": [[31, 40]]}
        payloads = [p async for p in operator.stream("GENERATE", **fields, steer=[steer])]
        core = Intervention(direction="zeta", layers=(2,), op=Op.ADD, value=5.0, prompt=True, generated=True)
        events = await direct(engine, [core])
        assert [p["token"] for p in payloads] == [e.token_id for e in events]
        np.testing.assert_allclose([p["readout"] for p in payloads], [e.readout for e in events], rtol=1e-5, atol=1e-5)
        assert all(len(p["readout"]) == len(TINY_LAYERS) * (len(TINY_CONCEPTS) + 1) for p in payloads)
        deleted = await operator.request("DELETE_CONCEPT", name="zeta")
        assert deleted == {
            "stream_id": deleted["stream_id"],
            "concept": "zeta",
            "deleted": True,
            "version": reply["version"] + 1,
        }
        with pytest.raises(LmtpStreamError, match="unknown direction 'zeta'"):
            _ = [p async for p in operator.stream("GENERATE", **fields, steer=[steer])]
    finally:
        await operator.close()


async def test_lmtp_an_ordinary_token_changes_nothing(engine: Engine, served: Frontends) -> None:
    client = await connect(served, ACCESS)
    try:
        version = engine.live.view().version
        for kind, fields in (
            ("DEFINE_CONCEPT", {"name": "eta", "vector": vector(2).tolist()}),
            ("DELETE_CONCEPT", {"name": "eta"}),
            ("SAVE_CONCEPTS", {}),
        ):
            with pytest.raises(LmtpStreamError, match="client 'token' lacks the scope 'define'"):
                await client.request(kind, **fields)
        assert engine.live.view().version == version
        # The stream beside it is untouched; the connection still serves.
        assert (await client.request("TOKENIZE", text="hello"))["tokens"]
    finally:
        await client.close()


async def test_lmtp_bad_define_lines_get_specific_errors(served: Frontends) -> None:
    operator = await connect(served, OPERATOR)
    try:
        cases = [
            ({"name": "x", "vector": "not base64!"}, "not valid base64"),
            ({"name": "x", "vector": base64.b64encode(b"abc").decode()}, "whole number of float32"),
            ({"name": "x", "vectors": {"first": [1.0]}}, "not a layer index"),
            ({"name": "x", "positive": "one text"}, "positive must be a list of texts"),
            ({"name": "x", "vector": vector(3)[:100].tolist()}, "hidden size is 128"),
            ({"name": "x", "positive": ["a b c"] * 2, "negative": ["d e f"] * 4}, "4 to 256"),
            ({"name": "alpha", "vector": vector(3).tolist()}, "loaded set"),
        ]
        for fields, words in cases:
            with pytest.raises(LmtpStreamError, match=words):
                await operator.request("DEFINE_CONCEPT", **fields)
    finally:
        await operator.close()


async def test_a_draining_server_refuses_defines(engine: Engine) -> None:
    async with frontends(engine) as other:
        other.status.draining()
        client = await LmtpClient.connect(other.ws)
        try:
            with pytest.raises(LmtpStreamError, match="draining"):
                await client.request("DEFINE_CONCEPT", name="eta", vector=vector(4).tolist())
        finally:
            await client.close()


async def test_grpc_defines_lists_saves_and_deletes(engine: Engine, served: Frontends, tmp_path: Path) -> None:
    async with AsyncSalienceClient(served.grpc_target, token=OPERATOR) as client:
        reply = await client.define_concept("theta", vector=vector(5).tobytes())
        assert reply.name == "theta" and not reply.HasField("info")
        manifest = await client.concept_manifest()
        assert manifest.version == reply.manifest_version
        assert [(c.name, c.live) for c in manifest.concepts][-1] == ("theta", True)
        steering = await client.steering_manifest()
        assert steering.vector_columns == 16 and "theta" in {d.name for d in steering.directions}
        path = tmp_path / "saved.safetensors"
        path.write_bytes(await client.save_concepts())
        saved = ConceptSet.load(path)
        assert saved.concepts == (*TINY_CONCEPTS, "theta")
        np.testing.assert_array_equal(saved.vectors[2][-1].numpy(), vector(5))
        deleted = await client.delete_concept("theta")
        assert deleted.manifest_version == reply.manifest_version + 1
    async with AsyncSalienceClient(served.grpc_target, token=ACCESS) as client:
        for call in (client.define_concept("iota", vector=vector(6).tobytes()), client.save_concepts()):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "lacks the scope 'define'" in error.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await client.define_concept("iota", vector=b"\0" * 12)
        assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED  # the permission is checked first


async def test_request_vectors_and_caps_over_both_wires(engine: Engine, served: Frontends) -> None:
    own = vector(7)
    core = [
        Intervention(
            direction="", vector=own.tobytes(), layers=(2,), op=Op.ADD, value=4.0, prompt=True, generated=True
        ),
        Intervention(direction="beta", layers=(3,), op=Op.CAP, lo=-0.5, hi=0.5, prompt=True, generated=True),
    ]
    events = await direct(engine, core)
    wire = [
        {
            "vector": base64.b64encode(own.tobytes()).decode(),
            "layers": [2],
            "op": "add",
            "value": 4.0,
            "positions": "all",
        },
        {"direction": "beta", "layers": [3], "op": "cap", "lo": -0.5, "hi": 0.5, "positions": "all"},
    ]
    client = await connect(served, ACCESS)
    try:
        fields = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "readout": [[31, 40]]}
        payloads = [p async for p in client.stream("GENERATE", **fields, steer=wire)]
        with pytest.raises(LmtpStreamError, match="hidden size is 128"):
            bad = [{**wire[0], "vector": own[:64].tolist()}]
            _ = [p async for p in client.stream("GENERATE", **fields, steer=bad)]
        with pytest.raises(LmtpStreamError, match=r"lo 1\.0 is above hi"):
            bad = [{**wire[1], "lo": 1.0}]
            _ = [p async for p in client.stream("GENERATE", **fields, steer=bad)]
    finally:
        await client.close()
    assert [p["token"] for p in payloads] == [e.token_id for e in events]
    np.testing.assert_allclose([p["readout"] for p in payloads], [e.readout for e in events], rtol=1e-5, atol=1e-5)
    async with AsyncSalienceClient(served.grpc_target, token=ACCESS) as grpc_client:
        session = await grpc_client.open_session("tiny")
        result = await session.generate(PROMPT, max_tokens=6, top_k=1, readout_ranges=[(31, 37)], steer=core)
        assert result.token_ids == [e.token_id for e in events]


def test_who_may_change_the_concepts() -> None:
    bearer = "Bearer {}".format

    def defines(tokens: Tokens, authorization: str | None = None) -> bool:
        client = tokens.identify(authorization)
        return client is not None and client.allows("define")

    assert defines(Tokens()) and Tokens().identify() is not None  # an open server: anyone (it warns at start)
    assert not defines(Tokens(ACCESS), bearer(ACCESS))  # auth without an operator token: nobody
    tokens = Tokens(ACCESS, OPERATOR)
    assert tokens.identify(bearer(ACCESS)) and tokens.identify(bearer(OPERATOR)) and not tokens.identify(bearer("x"))
    assert defines(tokens, bearer(OPERATOR)) and not defines(tokens, bearer(ACCESS))
    assert Tokens(None, OPERATOR).identify() is not None and not defines(Tokens(None, OPERATOR))


async def test_salience_concepts_save_writes_the_served_set_from_a_running_server(
    engine: Engine, served: Frontends, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from salience import cli

    operator = await connect(served, OPERATOR)
    try:
        await operator.request("DEFINE_CONCEPT", name="lambda", vector=vector(8).tolist())
    finally:
        await operator.close()
    path = tmp_path / "served.safetensors"
    command = ["concepts", "save", str(path), "--server", served.ws, "--token", OPERATOR]
    assert await asyncio.to_thread(cli.main, command) == 0
    assert ConceptSet.load(path).concepts == (*TINY_CONCEPTS, "lambda")
    assert "concepts: alpha, beta, gamma, delta, epsilon, lambda" in capsys.readouterr().out
    refused = ["concepts", "save", str(tmp_path / "no.safetensors"), "--server", served.ws, "--token", ACCESS]
    assert await asyncio.to_thread(cli.main, refused) == 2
    assert "lacks the scope 'define'" in capsys.readouterr().err
