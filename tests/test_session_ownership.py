"""Sessions belong to the client that opened them (docs/security.md#who-owns-a-session): to any other
client, on any wire, every operation on one is exactly an unknown id's (NOT_FOUND, the same message;
closing, as closing an unknown id, a no-op) and changes nothing, while the owner keeps doing
everything, on either wire. Another client is another name in the tokens file (the operator
included); on an open server, another peer address."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import grpc
import pytest
import pytest_asyncio

from salience.auth import Client, Tokens, token_digest
from salience.core.engine.chat import ChatRenderer, ChatTemplate
from salience.core.engine.chat_messages import ChatMessage
from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionStore
from salience.core.serving.turns import Turn
from salience.errors import NotFound, ResourceExhausted
from salience.grpc_frontend.auth import CLIENT, place_anonymous
from salience.lmtp.client import LmtpClient, LmtpStreamError
from salience.lmtp.session import LmtpConfig
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.grpc.test_chat import CHATML
from tests.inprocess import Frontends, frontends

PROMPT = [1, 2, 3]
WIRES = ("lmtp", "grpc")
UNKNOWN = "no-such-session"
NOT_FOUND = "no session '<id>': it was closed, evicted after idling, or never existed"
REFUSED = {"lmtp": NOT_FOUND, "grpc": f"NOT_FOUND: {NOT_FOUND}"}


def token(name: str) -> str:
    return f"token-of-{name}"


# ---- in the core: the one place the check lives --------------------------------------------------


async def test_the_store_finds_a_session_only_for_its_owner(tiny_engine: Engine) -> None:
    store = SessionStore(lambda: tiny_engine)
    mine = store.open("alice")
    async for _ in await store.start(mine, Turn(offset=0, append=PROMPT, client="alice")):
        pass
    refusals = {
        "tokens": lambda sid: store.tokens(sid, "bob"),
        "fork": lambda sid: store.fork(sid, 1, "bob"),
        "start": lambda sid: store.start(sid, Turn(offset=3, append=[4], client="bob")),
        "chat": lambda sid: store.chat(sid, [ChatMessage(role="user", content="hello")], Turn(offset=3, client="bob")),
    }
    for name, call in refusals.items():
        messages = []
        for session_id in (UNKNOWN, mine):
            with pytest.raises(NotFound) as refused:
                result = call(session_id)
                if asyncio.iscoroutine(result):
                    await result
            messages.append(str(refused.value).replace(session_id, "<id>"))
        assert messages == [NOT_FOUND, NOT_FOUND], name
    await store.close(mine, "bob")  # as closing an unknown id: nothing happens
    assert store.tokens(mine, "alice") == PROMPT and len(store) == 1
    # The limit on open sessions counts each owner's own.
    with pytest.raises(ResourceExhausted, match="client 'alice' holds 1 sessions"):
        store.open("alice", max_owned=1)
    store.open("bob", max_owned=1)
    await store.close(mine, "alice")
    with pytest.raises(NotFound):
        store.tokens(mine, "alice")


@pytest.mark.parametrize(
    ("peer", "owner"),
    [("ipv4:127.0.0.2:5555", "anonymous@127.0.0.2"), ("ipv6:[::1]:5555", "anonymous@::1")],
)
def test_grpc_writes_an_anonymous_peer_as_the_other_wires_do(peer: str, owner: str) -> None:
    """`anonymous@::1` on every wire (aiohttp's `request.remote` has no brackets), so that a peer's
    session opened over LMTP is its own over gRPC too."""

    class Context:
        def peer(self) -> str:
            return peer

    def placed() -> str:
        CLIENT.set(Tokens().stranger(None))
        place_anonymous(Context())
        return CLIENT.get().share

    assert contextvars.copy_context().run(placed) == owner


# ---- on the wires --------------------------------------------------------------------------------


@asynccontextmanager
async def relayed(source: str, target: str) -> AsyncIterator[str]:
    """A local address whose connections reach `target` from `source`: gRPC's Python client cannot
    choose the address it connects from, so a second peer's calls come through this."""
    host, port = target.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        await asyncio.gather(pipe(reader, upstream[1]), pipe(upstream[0], writer))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@dataclass(frozen=True)
class Caller:
    """A client as the server tells it: the token it offers (None: none), the address it comes from."""

    served: Frontends
    token: str | None = None
    source: str = "127.0.0.1"

    @asynccontextmanager
    async def lmtp(self) -> AsyncIterator[LmtpClient]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        http = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(local_addr=(self.source, 0)))
        client = LmtpClient(await http.ws_connect(self.served.ws), http)
        try:
            yield client
        finally:
            await client.close()

    @asynccontextmanager
    async def grpc(self) -> AsyncIterator[Callable[[str, object], Awaitable[object]]]:
        """`call(method, request)` on either service, as this client; a stream's events as a list."""
        metadata = (("authorization", f"Bearer {self.token}"),) if self.token else ()
        async with contextlib.AsyncExitStack() as stack:
            target = self.served.grpc_target
            if self.source != "127.0.0.1":
                target = await stack.enter_async_context(relayed(self.source, target))
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(target))
            stubs = (salience_pb2_grpc.SalienceStub(channel), extensions_pb2_grpc.SalienceExtensionsStub(channel))

            async def call(method: str, request: object) -> object:
                rpc = getattr(next(s for s in stubs if hasattr(s, method)), method)(request, metadata=metadata)
                return [event async for event in rpc] if hasattr(rpc, "__aiter__") else await rpc

            yield call

    async def open_session(self, wire: str) -> str:
        """A new session holding PROMPT."""
        if wire == "lmtp":
            async with self.lmtp() as lmtp:
                session_id = (await lmtp.request("OPEN_SESSION"))["session_id"]
        else:
            async with self.grpc() as call:
                session_id = (await call("OpenSession", pb.OpenSessionRequest())).session_id
        assert await self.attempt(wire, "append", session_id, 0) == "ok"
        return session_id

    async def dump(self, wire: str, session_id: str) -> list[int]:
        if wire == "lmtp":
            async with self.lmtp() as lmtp:
                return (await lmtp.request("DUMP_SESSION", session_id=session_id))["tokens"]
        async with self.grpc() as call:
            return list((await call("DumpSession", pb.DumpSessionRequest(session_id=session_id))).tokens)

    async def fork(self, wire: str, session_id: str, at: int) -> str:
        if wire == "lmtp":
            async with self.lmtp() as lmtp:
                return (await lmtp.request("FORK_SESSION", session_id=session_id, at_position=at))["session_id"]
        async with self.grpc() as call:
            return (await call("ForkSession", pb.ForkSessionRequest(session_id=session_id, at_position=at))).session_id

    async def attempt(self, wire: str, op: str, session_id: str, length: int = len(PROMPT)) -> str:
        """What operation `op` on `session_id` (believed `length` tokens long) came to: "ok", or its
        error (gRPC's with its code), the id written <id>."""
        try:
            if wire == "lmtp":
                kind, body = LMTP_OPS[op](length)
                async with self.lmtp() as lmtp:
                    if kind == "SESSION_GENERATE":
                        _ = [p async for p in lmtp.stream(kind, session_id=session_id, **body)]
                    else:
                        await lmtp.request(kind, session_id=session_id, **body)
            else:
                method, request = GRPC_OPS[op](session_id, length)
                async with self.grpc() as call:
                    await call(method, request)
        except LmtpStreamError as error:
            return str(error).replace(session_id, "<id>")
        except grpc.aio.AioRpcError as error:
            details = re.sub(r" \(request_id=[^)]*\)$", "", error.details() or "")
            return f"{error.code().name}: {details.replace(session_id, '<id>')}"
        return "ok"


LMTP_OPS: dict[str, Callable[[int], tuple[str, dict]]] = {
    "append": lambda n: ("SESSION_GENERATE", {"offset": n, "append": PROMPT}),
    "generate": lambda n: ("SESSION_GENERATE", {"offset": n, "max_tokens": 2, "temperature": 0}),
    "read": lambda n: ("SESSION_GENERATE", {"offset": n, "logprobs": [[1, n]], "top_logprobs": 1}),
    "rewind": lambda n: ("SESSION_GENERATE", {"offset": 1, "truncating": True, "append": [9]}),
    "dump": lambda n: ("DUMP_SESSION", {}),
    "fork": lambda n: ("FORK_SESSION", {"at_position": 1}),
    "close": lambda n: ("CLOSE_SESSION", {}),
}


def _turn(session_id: str, n: int, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(session_id=session_id, offset=n, **fields)


GRPC_OPS: dict[str, Callable[[str, int], tuple[str, object]]] = {
    "append": lambda s, n: ("Generate", _turn(s, n, append_tokens=PROMPT)),
    "generate": lambda s, n: ("Generate", _turn(s, n, max_tokens=2, top_k=1)),
    "read": lambda s, n: ("Generate", _turn(s, n, logprobs_ranges=[pb.PositionRange(start=1, end=n)])),
    "rewind": lambda s, n: ("Generate", _turn(s, 1, truncating=True, append_tokens=[9])),
    "extended": lambda s, n: ("ExtendedGenerate", ext.ExtendedGenerateRequest(generate=_turn(s, n, max_tokens=2))),
    "steered": lambda s, n: ("SteeredGenerate", ext.SteeredGenerateRequest(generate=_turn(s, n, max_tokens=2))),
    "chat": lambda s, n: (
        "ChatGenerate",
        ext.ChatGenerateRequest(
            turn=ext.ExtendedGenerateRequest(generate=_turn(s, n, max_tokens=2)),
            messages=[ext.ChatMessage(role="user", content="hello")],
        ),
    ),
    "dump": lambda s, n: ("DumpSession", pb.DumpSessionRequest(session_id=s)),
    "fork": lambda s, n: ("ForkSession", pb.ForkSessionRequest(session_id=s, at_position=1)),
    "close": lambda s, n: ("CloseSession", pb.CloseSessionRequest(session_id=s)),
}
OPS = {"lmtp": LMTP_OPS, "grpc": GRPC_OPS}


async def assert_unreachable(caller: Caller, wire: str, session_id: str) -> None:
    """Every operation `caller` tries on the session is an unknown id's, word for word: NOT_FOUND
    (a close, as an unknown id's, passes and does nothing)."""
    for op in OPS[wire]:
        unknown = await caller.attempt(wire, op, UNKNOWN)
        assert unknown == ("ok" if op == "close" else REFUSED[wire]), (wire, op)
        assert await caller.attempt(wire, op, session_id) == unknown, (wire, op)


@pytest_asyncio.fixture(scope="module")
async def named(tiny_engine: Engine) -> AsyncIterator[Frontends]:
    """Two named clients with every session scope, and the operator."""
    clients = [
        (token_digest(token(name)), Client(name=name, scopes=frozenset({"sessions", "generate", "steer"})))
        for name in ("alice", "bob")
    ]
    tokens = Tokens(operator=token("admin"), clients=clients)
    async with frontends(tiny_engine, lmtp=LmtpConfig(tokens=tokens), grpc_tokens=tokens) as served:
        yield served


@pytest_asyncio.fixture(scope="module")
async def open_server(tiny_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(tiny_engine) as served:
        yield served


@pytest.mark.parametrize("stranger", ["bob", "admin"])
@pytest.mark.parametrize("opened_on", WIRES)
async def test_another_clients_session_is_not_found_on_every_wire(
    named: Frontends, opened_on: str, stranger: str
) -> None:
    alice = Caller(named, token("alice"))
    session_id = await alice.open_session(opened_on)
    for wire in WIRES:
        await assert_unreachable(Caller(named, token(stranger)), wire, session_id)
    for wire in WIRES:  # not appended, rewound, forked from or closed: the owner finds it as it was
        assert await alice.dump(wire, session_id) == PROMPT


@pytest.mark.parametrize("opened_on", WIRES)
@pytest.mark.parametrize("used_on", WIRES)
async def test_the_owner_does_everything_on_either_wire(
    named: Frontends, tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, opened_on: str, used_on: str
) -> None:
    monkeypatch.setattr(tiny_engine, "chat", ChatRenderer(tiny_engine.tokenizer, ChatTemplate(CHATML, "test")))
    alice, bob = Caller(named, token("alice")), Caller(named, token("bob"))
    session_id = await alice.open_session(opened_on)
    for op in OPS[used_on]:
        if op not in ("chat", "close"):
            length = len(await alice.dump(opened_on, session_id))
            assert await alice.attempt(used_on, op, session_id, length) == "ok", op
    child = await alice.fork(used_on, session_id, 0)  # a fork is its maker's
    assert await alice.dump(opened_on, child) == []
    assert await bob.attempt(opened_on, "dump", child) == REFUSED[opened_on]
    if used_on == "grpc":  # a chat, in a session holding no tokens appended outside the chat
        assert await alice.attempt(used_on, "chat", child, 0) == "ok"
    assert await alice.attempt(used_on, "close", session_id) == "ok"
    assert await alice.attempt(opened_on, "dump", session_id) == REFUSED[opened_on]


async def test_on_an_open_server_another_peer_address_is_another_client(open_server: Frontends) -> None:
    here, there = Caller(open_server), Caller(open_server, source="127.0.0.2")
    for opened_on in WIRES:
        session_id = await here.open_session(opened_on)
        for wire in WIRES:
            await assert_unreachable(there, wire, session_id)
        for wire in WIRES:  # the same address on the other wire is the same client
            assert await here.dump(wire, session_id) == PROMPT
