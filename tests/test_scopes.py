"""Tokens with scopes and limits, on a real server: the tokens file and `salience tokens`, the scope
table in docs/security.md against the server's own operations, that table walked over LMTP, HTTP
and gRPC (each operation refused to a client lacking its scope, naming it, and let through to one
holding it), the scopes a request's fields ask for, and each limit refused with its retry-after."""

from __future__ import annotations

import collections
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio

from salience.auth import SCOPES, Client, ClientLimits, Tokens, token_digest
from salience.core.engine.engine import Engine
from salience.core.engine.token_meter import TokenMeter
from salience.errors import InvalidArgument
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.lmtp.fields import TYPES
from salience.lmtp.session import LmtpConfig
from salience.proto.salience.ext.v1 import extensions_pb2, extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2, salience_pb2_grpc
from salience.scopes import OPEN, OPERATIONS, needs
from salience.token_file import add_client, load_token_file
from tests.inprocess import Frontends, frontends

DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
WIRE_SCOPES = [scope for scope in SCOPES if scope != "admin"]


def token(name: str) -> str:
    return f"token-of-{name}"


def clients() -> list[tuple[bytes, Client]]:
    """`all` holds every scope but admin; `no-S` every one but S; `slow` is held to limits."""
    made = [("all", frozenset(WIRE_SCOPES), ClientLimits())]
    made += [(f"no-{scope}", frozenset(WIRE_SCOPES) - {scope}, ClientLimits()) for scope in WIRE_SCOPES]
    made.append(("slow", frozenset(WIRE_SCOPES), ClientLimits(streams=1, sessions=1, tokens_per_minute=40)))
    return [
        (token_digest(token(name)), Client(name=name, scopes=scopes, limits=limits)) for name, scopes, limits in made
    ]


# ---- the file and the command -----------------------------------------------------------------


def test_a_client_added_by_the_command_is_loaded_with_its_scopes_and_limits(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    first = add_client(path, "alice", ["generate", "readouts"], ClientLimits(streams=2, tokens_per_minute=600))
    second = add_client(path, "bob", ["admin"], weight=2.0)
    assert first != second and first not in path.read_text()  # only the hash is written
    assert path.stat().st_mode & 0o777 == 0o600
    (alice_digest, alice), (_, bob) = load_token_file(path)
    assert alice_digest == token_digest(first)
    assert alice == Client(
        name="alice", scopes=frozenset({"generate", "readouts"}), limits=ClientLimits(streams=2, tokens_per_minute=600)
    )
    assert bob.weight == 2.0 and bob.allows("define")
    tokens = Tokens(clients=load_token_file(path))
    assert tokens.identify(f"Bearer {first}") == alice and tokens.identify("Bearer wrong") is None
    assert tokens.identify() is None  # a server with a tokens file requires a token


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[client]]\nname = 'a'\n", "client 1 (a): sha256 must be the token's SHA-256"),
        ("[[client]]\nname = 'a b'\n", "client 1: name must be 1 to 64 of"),
        ("[[client]]\nname = 'token'\n", "client 1 (token): the name is reserved for --auth-token"),
        (f"[[client]]\nname = 'a'\nsha256 = '{'0' * 64}'\nscopes = ['gen']\n", "unknown scope 'gen'"),
        (f"[[client]]\nname = 'a'\nsha256 = '{'0' * 64}'\nscopes = []\n", "scopes must be a non-empty list"),
        (f"[[client]]\nname = 'a'\nsha256 = '{'0' * 64}'\nscopes = ['score']\nmax_streams = 0\n", "max_streams"),
        (f"[[client]]\nname = 'a'\nsha256 = '{'0' * 64}'\nscopes = ['score']\ncolour = 1\n", "unknown field 'colour'"),
        (
            f"[[client]]\nname = 'a'\nsha256 = '{'0' * 64}'\nscopes = ['score']\n"
            f"[[client]]\nname = 'a'\nsha256 = '{'1' * 64}'\nscopes = ['score']\n",
            "client 2: the name 'a' is taken",
        ),
        ("[[client]\n", "not TOML"),
        ("[server]\n", "unknown table 'server'"),
    ],
)
def test_a_bad_tokens_file_is_refused_naming_the_entry_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        load_token_file(path)


def test_the_meter_counts_a_minute_of_tokens_and_says_when_a_limit_frees() -> None:
    now = [1000.0]
    meter = TokenMeter(clock=lambda: now[0])
    meter.add("a", 30)
    now[0] = 1020.5
    meter.add("a", 20)
    meter.add("b", 5)
    assert (meter.recent("a"), meter.recent("b"), meter.recent("c")) == (50, 5, 0)
    assert meter.wait("a", 60) == 0.0
    assert meter.wait("a", 50) == pytest.approx(1001 + 60 - 1020.5)  # when the first 30 are a minute old
    assert meter.wait("a", 10) == pytest.approx(1021 + 60 - 1020.5)  # both buckets must age out
    now[0] = 1061.0
    assert meter.recent("a") == 20
    now[0] = 1082.0
    assert meter.recent("a") == 0 and meter.wait("a", 1) == 0.0


def test_the_docs_table_is_the_servers() -> None:
    """docs/security.md lists exactly the operations the server checks, with the same scopes, and
    the server checks every operation its wires carry."""
    rows = re.findall(r"^\| (LMTP|HTTP|gRPC) \| `([^`]+)` \| (.+) \|$", DOC.read_text(), re.MULTILINE)
    documented = {}
    for wire, name, scopes in rows:
        key = f"LMTP {name}" if wire == "LMTP" else name
        documented[key] = (
            OPEN
            if scopes == "none (no token)"
            else ()
            if scopes == "any client"
            else tuple(re.findall(r"`(\w+)`", scopes))
        )
    assert documented == OPERATIONS
    assert {f"LMTP {name}" for name in TYPES} <= set(OPERATIONS)
    for module in (salience_pb2, extensions_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            assert {f"{service.full_name}/{method.name}" for method in service.methods} <= set(OPERATIONS)


# ---- on a real server ---------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module")
async def served(tiny_engine: Engine) -> AsyncIterator[Frontends]:
    tokens = Tokens(clients=clients())
    async with frontends(tiny_engine, lmtp=LmtpConfig(tokens=tokens), grpc_tokens=tokens) as served:
        yield served


LMTP_BODIES = {
    "GENERATE": {"prompt": [1, 2, 3], "max_tokens": 1},
    "SCORE": {"prompt": [1, 2, 3], "scored": [4]},
    "SESSION_GENERATE": {"session_id": "nope", "offset": 0, "append": [1]},
    "OPEN_SESSION": {},
    "CLOSE_SESSION": {"session_id": "nope"},
    "FORK_SESSION": {"session_id": "nope", "at_position": 0},
    "DUMP_SESSION": {"session_id": "nope"},
    "DEFINE_CONCEPT": {"name": "zz", "vector": [1.0]},  # a bad vector: refused after the scope, changes nothing
    "DELETE_CONCEPT": {"name": "zz"},
    "SAVE_CONCEPTS": {},
    "PATCH_SWEEP": {"clean": [1, 2], "corrupted": [1, 3], "answer": [4]},  # refused after the scope: no patch points
}
HTTP_BODIES = {
    "POST /v1/completions": {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1},
    "POST /v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "POST /v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 1, "store": False},
    "GET /v1/responses/{id}": {},
    "DELETE /v1/responses/{id}": {},
}


async def lmtp_error(served: Frontends, client: str, kind: str, body: dict) -> str | None:
    """The error the request got (None: it passed)."""
    lmtp = await LmtpClient.connect(served.ws, {"Authorization": f"Bearer {token(client)}"})
    try:
        if kind in ("GENERATE", "SCORE", "SESSION_GENERATE"):
            _ = [payload async for payload in lmtp.stream(kind, **body)]  # an error payload raises
        else:
            await lmtp.request(kind, **body)
        return None
    except LmtpStreamError as exc:
        return str(exc)
    finally:
        await lmtp.close()


async def http_error(served: Frontends, client: str, operation: str, body: dict) -> tuple[int, dict]:
    method, path = operation.split(" ")
    path = path.replace("{id}", "resp_unknown")  # a route's placeholder, as a client fills it
    headers = {"Authorization": f"Bearer {token(client)}"}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, served.http + path, json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


def grpc_call(served: Frontends, operation: str) -> Callable[[str], Awaitable[object]]:
    """Call `operation` with an empty request, as `client`."""
    service, method = operation.split("/")
    module, stub = (
        (salience_pb2, salience_pb2_grpc.SalienceStub)
        if service.startswith("salience.v1")
        else (extensions_pb2, extensions_pb2_grpc.SalienceExtensionsStub)
    )
    request_type = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]].methods_by_name[method].input_type
    request = getattr(module, request_type.name)()

    async def call(client: str) -> object:
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            rpc = getattr(stub(channel), method)(request, metadata=(("authorization", f"Bearer {token(client)}"),))
            if hasattr(rpc, "__aiter__"):
                return [item async for item in rpc]
            return await rpc

    return call


def denial(scope: str, client: str) -> str:
    return f"client {client!r} lacks the scope {scope!r} this request needs"


WALKED = [op for op, scopes in OPERATIONS.items() if scopes != OPEN and scopes]


@pytest.mark.parametrize("operation", WALKED)
async def test_each_operation_needs_its_scope_on_its_wire(served: Frontends, operation: str) -> None:
    """Refused to a client lacking the operation's first scope, naming it; let through (to
    whatever else it meets: an unknown session, a bad vector) to a client holding it."""
    scope = needs(operation)[0]
    lacking = f"no-{scope}"
    if operation.startswith("LMTP "):
        kind = operation.removeprefix("LMTP ")
        assert denial(scope, lacking) in (await lmtp_error(served, lacking, kind, LMTP_BODIES[kind]) or "")
        assert "lacks the scope" not in (await lmtp_error(served, "all", kind, LMTP_BODIES[kind]) or "")
    elif operation.startswith(("GET ", "POST ", "DELETE ")):
        status, body = await http_error(served, lacking, operation, HTTP_BODIES[operation])
        assert status == 403 and body["error"]["type"] == "permission_error"
        assert denial(scope, lacking) in body["error"]["message"]
        status, body = await http_error(served, "all", operation, HTTP_BODIES[operation])
        assert status != 403, body
    else:
        call = grpc_call(served, operation)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(lacking)
        assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert denial(scope, lacking) in refused.value.details()
        try:
            await call("all")
        except grpc.aio.AioRpcError as error:
            assert error.code() is not grpc.StatusCode.PERMISSION_DENIED, error.details()


FIELDS = {
    "readouts": {"readout": [[0, 4]]},
    "steer": {"steer": [{"vector": [0.0] * 127 + [1.0], "layers": [1], "value": 1.0}]},
    "residual": {"residual": {"layers": [1], "ranges": [[0, 2]]}},
    "features": {"features": {"k": 2, "ranges": [[0, 2]]}},
}


@pytest.mark.parametrize("scope", FIELDS)
async def test_a_field_asks_for_its_scope_on_every_wire(served: Frontends, scope: str) -> None:
    lacking = f"no-{scope}"
    body = {**LMTP_BODIES["GENERATE"], **FIELDS[scope]}
    assert denial(scope, lacking) in (await lmtp_error(served, lacking, "GENERATE", body) or "")
    extension = {"readouts": {"salience": {"readouts": {}}}, "steer": {"salience": {"steer": FIELDS["steer"]["steer"]}}}
    if scope in extension:  # the OpenAI extension carries readouts and steering
        status, reply = await http_error(
            served, lacking, "POST /v1/completions", {**HTTP_BODIES["POST /v1/completions"], **extension[scope]}
        )
        assert status == 403 and denial(scope, lacking) in reply["error"]["message"]


async def test_the_connection_carries_on_after_a_refusal(served: Frontends) -> None:
    lmtp = await LmtpClient.connect(served.ws, {"Authorization": f"Bearer {token('no-steer')}"})
    try:
        with pytest.raises(LmtpStreamError, match="lacks the scope 'steer'"):
            _ = [p async for p in lmtp.stream("GENERATE", **LMTP_BODIES["GENERATE"], **FIELDS["steer"])]
        payloads = [p async for p in lmtp.stream("GENERATE", prompt=[1, 2, 3], max_tokens=3, temperature=0)]
        assert payloads[-1]["finish_reason"] == "length"
    finally:
        await lmtp.close()


async def test_each_limit_is_refused_with_its_retry_after(served: Frontends) -> None:
    slow = {"Authorization": f"Bearer {token('slow')}"}
    async with aiohttp.ClientSession() as http, http.ws_connect(served.ws, headers=slow) as ws:
        received: dict[int, list[dict]] = collections.defaultdict(list)

        async def next_of(stream_id: int) -> dict:
            while not received[stream_id]:
                for payload in json.loads((await ws.receive()).data.partition(" ")[2]):
                    received[payload.get("stream_id")].append(payload)
            return received[stream_id].pop(0)

        async def ask(kind: str, **body) -> dict:
            """The request's first payload: an error, a result or its first token."""
            await ws.send_str(f"{kind} {json.dumps(body)}")
            return await next_of(body["stream_id"])

        # Streams: while one runs, a second is refused on every wire.
        # The whole context: it must outlast the refusals on every wire; it ends by a CANCEL.
        first = await ask("GENERATE", stream_id=1, prompt=[1, 2, 3], max_tokens=2045, ignore_eos=True, temperature=0)
        assert "token" in first
        refused = await ask("GENERATE", stream_id=2, **LMTP_BODIES["GENERATE"])
        assert "runs 1 streams, its limit" in refused["error"] and refused["retry_after"] == 1.0
        completions = HTTP_BODIES["POST /v1/completions"]
        async with http.post(f"{served.http}/v1/completions", json=completions, headers=slow) as reply:
            assert reply.status == 429 and reply.headers["Retry-After"] == "1"
            assert (await reply.json())["error"]["type"] == "rate_limit_error"
        async with grpc.aio.insecure_channel(served.grpc_target) as channel:
            stub = salience_pb2_grpc.SalienceStub(channel)
            metadata = (("authorization", slow["Authorization"]),)
            session = await stub.OpenSession(salience_pb2.OpenSessionRequest(), metadata=metadata)
            turn = salience_pb2.GenerateRequest(session_id=session.session_id, append_tokens=[1, 2], max_tokens=1)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                _ = [event async for event in stub.Generate(turn, metadata=metadata)]
            assert error.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(error.value.trailing_metadata())["retry-after"] == "1"
            # Sessions: it holds one (opened over gRPC); a second is refused until the first expires.
            refused = await ask("OPEN_SESSION", stream_id=3)
            assert "holds 1 sessions, its limit" in refused["error"] and 1700 < refused["retry_after"] <= 1800
            await stub.CloseSession(salience_pb2.CloseSessionRequest(session_id=session.session_id), metadata=metadata)
        assert "session_id" in await ask("OPEN_SESSION", stream_id=4)
        # Tokens per minute: the running stream has made more than 40; once it ends, a new one
        # is refused until they are a minute old.
        made = 1
        while made <= 40:
            made += "token" in await next_of(1)
        await ws.send_str('CANCEL {"stream_id": 1}')
        while not (await next_of(1)).get("finish_reason"):
            pass
        refused = await ask("GENERATE", stream_id=5, **LMTP_BODIES["GENERATE"])
        assert "tokens generated over the last minute, its limit is 40" in refused["error"]
        assert 55 < refused["retry_after"] <= 61


async def test_fair_share_counts_a_named_client_as_one_and_an_open_servers_by_peer(
    served: Frontends, tiny_engine: Engine
) -> None:
    """Whom fair share counts a stream against, on every wire: a token's client by name, however
    many connections it opens; on an open server, the peer's address."""
    assert tiny_engine.fair_share is not None
    long = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def running_clients(url: str, grpc_target: str, headers: dict[str, str]) -> set[str]:
        """The keys whose counters the streams of two connections and a gRPC turn moved."""
        before = tiny_engine.fair_share.counters()
        connections = [await LmtpClient.connect(url, headers) for _ in range(2)]
        streams = [lmtp.stream("GENERATE", **long) for lmtp in connections]
        metadata = tuple((key.lower(), value) for key, value in headers.items())
        async with grpc.aio.insecure_channel(grpc_target) as channel:
            stub = salience_pb2_grpc.SalienceStub(channel)
            session = await stub.OpenSession(salience_pb2.OpenSessionRequest(), metadata=metadata)
            turn = salience_pb2.GenerateRequest(session_id=session.session_id, append_tokens=[1, 2], max_tokens=400)
            call = stub.Generate(turn, metadata=metadata)
            try:
                for stream in streams:
                    await anext(stream)
                await call.read()
                during = tiny_engine.fair_share.counters()
                return {key for key, served in during.items() if served > before.get(key, -1.0)}
            finally:
                call.cancel()
                for lmtp in connections:
                    await lmtp.close()

    assert await running_clients(served.ws, served.grpc_target, {"Authorization": f"Bearer {token('all')}"}) == {"all"}
    async with frontends(tiny_engine) as open_server:
        assert await running_clients(open_server.ws, open_server.grpc_target, {}) == {"anonymous@127.0.0.1"}
