"""A reload of the tokens file (SIGHUP) reaches the connections already open (docs/security.md,
"Reload"): on one LMTP WebSocket, one keep-alive HTTP connection and one gRPC channel each, a
client removed from the file is refused as a wrong token is and a narrowed one needs its new
scopes, while what it started before runs to its end; a removed client's WebSocket then closes
with 4401 by itself. LMTP over TCP (an open server's) carries on as it was. The reload is the
server's own handler (`server._reload`), run by a real SIGHUP on the test's loop. Without an
engine: a tokens file, even an empty one, requires a token, and a connection's client costs a
hash only after a reload."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from salience import auth, server
from salience.auth import Client, Identity, Tokens, token_digest
from salience.core.engine.engine import Engine
from salience.lmtp.codec import parse_server_line
from salience.lmtp.session import UNAUTHORIZED, LmtpConfig
from salience.lmtp.websocket import AUTH_CLOSE_CODE
from salience.proto.salience.v1 import salience_pb2, salience_pb2_grpc
from tests.inprocess import Frontends, frontends

LONG = {"prompt": [1, 2, 3], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
WHOLE = LONG | {"max_tokens": 2048 - 3}  # tiny_engine's context: a stream to cancel, never done first
SHORT = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
SCORE = {"prompt": [1, 2, 3], "scored": [4]}
BEFORE = {"alice": ["generate", "score", "sessions"], "bob": ["generate", "score", "sessions"]}
AFTER = {"bob": ["score", "sessions"]}  # alice removed; bob may no longer generate


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer token-of-{name}"}


def write_tokens(path: Path, clients: dict[str, list[str]]) -> None:
    path.write_text(
        "".join(
            f'[[client]]\nname = "{name}"\nsha256 = "{token_digest(f"token-of-{name}").hex()}"\nscopes = {scopes}\n'
            for name, scopes in clients.items()
        )
    )


@dataclass
class Served:
    frontends: Frontends
    tokens: Tokens
    path: Path

    async def reload(self, clients: dict[str, list[str]]) -> None:
        """Rewrite the file and send SIGHUP; back once the server's handler has run (polled by the
        millisecond: the streams started before must still run when the test goes on)."""
        write_tokens(self.path, clients)
        generation = self.tokens.generation
        os.kill(os.getpid(), signal.SIGHUP)
        async with asyncio.timeout(10):
            while self.tokens.generation == generation:
                await asyncio.sleep(0.001)


@pytest_asyncio.fixture
async def served(tiny_engine: Engine, tmp_path: Path) -> AsyncIterator[Served]:
    """The frontends with a tokens file, as `salience serve --tokens FILE` makes them, SIGHUP
    reloading it on this loop."""
    path = tmp_path / "tokens.toml"
    write_tokens(path, BEFORE)
    tokens = server._tokens(server.ServeOptions(tokens_file=path))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, functools.partial(server._reload, None, tokens, path))
    try:
        async with frontends(tiny_engine, lmtp=LmtpConfig(tokens=tokens), grpc_tokens=tokens) as running:
            yield Served(running, tokens, path)
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


def auth_failures(frontend: str) -> float:
    return REGISTRY.get_sample_value("salience_auth_failures_total", {"frontend": frontend}) or 0.0


@dataclass
class Socket:
    """An LMTP WebSocket read by hand, to see its close code: payloads filed by stream id."""

    ws: aiohttp.ClientWebSocketResponse
    received: dict[int, list[dict]] = field(default_factory=lambda: collections.defaultdict(list))

    async def send(self, kind: str, **body: object) -> None:
        await self.ws.send_str(f"{kind} {json.dumps(body)}")

    async def next_of(self, stream_id: int) -> dict:
        while not self.received[stream_id]:
            message = await asyncio.wait_for(self.ws.receive(), 60)
            assert message.type is aiohttp.WSMsgType.TEXT, (message, self.ws.close_code)
            for payload in parse_server_line(message.data)[1]:
                self.received[payload["stream_id"]].append(payload)
        return self.received[stream_id].pop(0)

    async def ask(self, kind: str, stream_id: int, **body: object) -> dict:
        """The request's first payload: an error, a reply, or a stream's first token."""
        await self.send(kind, stream_id=stream_id, **body)
        return await self.next_of(stream_id)

    async def rest_of(self, stream_id: int) -> list[dict]:
        """Its payloads up to the terminal one."""
        payloads = [await self.next_of(stream_id)]
        while payloads[-1].get("finish_reason") is None and "error" not in payloads[-1]:
            payloads.append(await self.next_of(stream_id))
        return payloads

    async def close_code(self) -> int:
        """The code of the server's close frame, whose reason must be UNAUTHORIZED; nothing else
        may arrive first. (aiohttp's `close_code` may say 1006 instead: the server closes the
        socket before the client's own close frame goes out.)"""
        message = await asyncio.wait_for(self.ws.receive(), 30)
        assert message.type is aiohttp.WSMsgType.CLOSE and message.extra == UNAUTHORIZED, message
        return message.data


@pytest_asyncio.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def socket(http: aiohttp.ClientSession, served: Served, name: str) -> Socket:
    return Socket(await http.ws_connect(served.frontends.ws, headers=bearer(name)))


async def test_a_removed_clients_websocket_finishes_its_streams_then_closes_4401(
    served: Served, http: aiohttp.ClientSession
) -> None:
    running, idle = await socket(http, served, "alice"), await socket(http, served, "alice")
    assert "token" in await running.ask("GENERATE", 1, **LONG)
    assert "token" in await running.ask("GENERATE", 2, **WHOLE)
    failures = auth_failures("lmtp_ws")
    await served.reload(AFTER)

    # A connection with nothing running closes at once, though its client sends nothing.
    assert await idle.close_code() == AUTH_CLOSE_CODE
    assert idle.ws.closed
    # New requests are refused as a wrong token is, and counted so; a CANCEL of its own stream goes through.
    refused = await running.ask("GENERATE", 3, **SHORT)
    assert refused["error"] == UNAUTHORIZED and refused["request_id"]
    assert not any(p.get("finish_reason") for p in running.received[1])  # refused while its stream runs
    assert (await running.ask("TOKENIZE", 4, text="hi"))["error"] == UNAUTHORIZED
    assert auth_failures("lmtp_ws") == failures + 2
    assert REGISTRY.get_sample_value("salience_errors_total", {"frontend": "lmtp_ws", "kind": "Unauthorized"}) is None
    await running.send("CANCEL", stream_id=2)
    assert (await running.rest_of(2))[-1]["finish_reason"] == "cancelled"
    # The stream it started before the reload runs to its end; then the socket closes.
    assert not running.ws.closed
    ended = await running.rest_of(1)
    assert len([p for p in ended if "token" in p]) == LONG["max_tokens"] - 1  # the first was read before
    assert ended[-1]["finish_reason"] == "length"
    assert await running.close_code() == AUTH_CLOSE_CODE


async def test_a_narrowed_client_keeps_its_websocket_and_needs_its_new_scopes(
    served: Served, http: aiohttp.ClientSession
) -> None:
    bob = await socket(http, served, "bob")
    assert "token" in await bob.ask("GENERATE", 1, **LONG)
    await served.reload(AFTER)

    refused = await bob.ask("GENERATE", 2, **SHORT)
    assert refused["error"] == "client 'bob' lacks the scope 'generate' this request needs"
    assert not any(p.get("finish_reason") for p in bob.received[1])  # refused while its stream runs
    await bob.send("SCORE", stream_id=3, **SCORE)
    scored = await bob.rest_of(3)
    assert "error" not in scored[-1] and scored[-1]["finish_reason"], scored
    assert "session_id" in await bob.ask("OPEN_SESSION", 4)
    ended = await bob.rest_of(1)  # the stream it started when it could still generate
    assert len([p for p in ended if "token" in p]) == LONG["max_tokens"] - 1 and ended[-1]["finish_reason"] == "length"
    assert (await bob.ask("STATUS", 5))["status"] == "ready" and not bob.ws.closed


async def test_an_open_servers_tcp_connection_carries_on_across_a_reload(tiny_engine: Engine) -> None:
    """LMTP over TCP is only served open: no file, so nothing a reload could change; its client is
    the anonymous one, identified again by the same mechanism as a WebSocket's."""
    tokens = Tokens()
    async with frontends(tiny_engine, tcp=LmtpConfig(tokens=tokens), grpc_tokens=tokens) as running:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.tcp_port)
        try:

            async def generate(stream_id: int, max_tokens: int) -> list[dict]:
                body = {**SHORT, "stream_id": stream_id, "max_tokens": max_tokens}
                writer.write(f"GENERATE {json.dumps(body)}\n".encode())
                payloads: list[dict] = []
                while not payloads or payloads[-1].get("finish_reason") is None:
                    line = await asyncio.wait_for(reader.readline(), 60)
                    assert line, "the connection closed"
                    payloads += parse_server_line(line.decode())[1]
                    assert "error" not in payloads[-1], payloads[-1]
                return payloads

            assert (await generate(1, 2))[-1]["finish_reason"] == "length"
            tokens.reload([])  # what a SIGHUP does to a server's clients
            assert (await generate(2, 3))[-1]["finish_reason"] == "length"
            assert not reader.at_eof()
        finally:
            writer.close()


@dataclass
class Connections:
    """How many connections an aiohttp session made, and how many requests reused one."""

    made: int = 0
    reused: int = 0

    def trace(self) -> aiohttp.TraceConfig:
        config = aiohttp.TraceConfig()

        async def made(*_: object) -> None:
            self.made += 1

        async def reused(*_: object) -> None:
            self.reused += 1

        config.on_connection_create_end.append(made)
        config.on_connection_reuseconn.append(reused)
        return config


@pytest.mark.parametrize(
    ("name", "status", "message"),
    [
        ("alice", 401, "missing or wrong bearer token (Authorization: Bearer ...)"),
        ("bob", 403, "client 'bob' lacks the scope 'generate' this request needs"),
    ],
)
async def test_a_keep_alive_http_connection_follows_the_reload(
    served: Served, name: str, status: int, message: str
) -> None:
    counted = Connections()
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    url = f"{served.frontends.http}/v1/completions"
    failures = auth_failures("openai")
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1), trace_configs=[counted.trace()], headers=bearer(name)
    ) as http:
        async with http.post(url, json=body) as reply:
            assert reply.status == 200, await reply.text()
        await served.reload(AFTER)
        async with http.post(url, json=body) as reply:
            assert reply.status == status and (await reply.json())["error"]["message"] == message
        async with http.get(f"{served.frontends.http}/v1/models") as reply:
            assert reply.status == (401 if name == "alice" else 200)  # listing needs no scope
    assert (counted.made, counted.reused) == (1, 2)  # one connection, kept alive across the reload
    assert auth_failures("openai") == failures + (2 if name == "alice" else 0)


async def test_a_grpc_channel_follows_the_reload(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.frontends.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        metadata = {name: (("authorization", bearer(name)["Authorization"]),) for name in ("alice", "bob")}

        async def turn(name: str) -> list[object]:
            session = await stub.OpenSession(salience_pb2.OpenSessionRequest(), metadata=metadata[name])
            request = salience_pb2.GenerateRequest(session_id=session.session_id, append_tokens=[1, 2], max_tokens=2)
            return [event async for event in stub.Generate(request, metadata=metadata[name])]

        assert await turn("alice") and await turn("bob")
        await served.reload(AFTER)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.OpenSession(salience_pb2.OpenSessionRequest(), metadata=metadata["alice"])
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await turn("bob")  # its session opens; its turn needs `generate`
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "lacks the scope 'generate'" in denied.value.details()
        assert channel.get_state() is grpc.ChannelConnectivity.READY  # the same channel throughout


# ---- without an engine ----------------------------------------------------------------------


def test_a_tokens_file_requires_a_token_even_empty_and_after_a_reload_fills_it(tmp_path: Path) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text("")
    tokens = server._tokens(server.ServeOptions(tokens_file=path))
    assert tokens.required and tokens.identify() is None and tokens.identify("Bearer anything") is None
    write_tokens(path, {"carol": ["generate"]})
    server._reload(None, tokens, path)
    assert tokens.required and tokens.identify(peer="127.0.0.1") is None
    assert tokens.identify(bearer("carol")["Authorization"]).name == "carol"
    assert not server._tokens(server.ServeOptions()).required  # no file, no token: open


def test_an_identity_hashes_only_after_a_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection's client is read at every message: between reloads that costs no hashing."""
    digests = []
    monkeypatch.setattr(auth, "token_digest", lambda token: digests.append(token) or token_digest(token))
    dave = Client(name="dave", scopes=frozenset({"generate"}))
    tokens = Tokens(clients=[(token_digest("token-of-dave"), dave)])
    identity = Identity(tokens, bearer("dave")["Authorization"])
    assert [identity.client for _ in range(100)] == [dave] * 100 and len(digests) == 1

    class Watcher:
        reloads = 0

        def tokens_reloaded(self) -> None:
            self.reloads += 1

    watcher = Watcher()
    tokens.watch(watcher)
    tokens.reload([])
    assert watcher.reloads == 1
    assert identity.client is None and identity.client is None and len(digests) == 2
    tokens.reload([(token_digest("token-of-dave"), dave)])
    assert identity.client == dave and len(digests) == 3
