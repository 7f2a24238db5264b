"""An in-process LMTP server on the tiny model, shared by a test module."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest_asyncio
from aiohttp import web

from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.http_app import make_app
from salience.lmtp.codec import parse_server_line
from salience.lmtp.session import ConnectionLimits, LmtpConfig
from salience.lmtp.tcp import start_tcp_server
from tests.conftest import free_port


@dataclass
class LmtpServer:
    engine: Engine
    status: ServerStatus
    sessions: SessionStore
    url: str
    tcp_port: int


@pytest_asyncio.fixture(scope="module")
async def lmtp_server(tiny_engine: Engine) -> AsyncIterator[LmtpServer]:
    status = ServerStatus("tiny", {"tiny-alias"})
    status.ready(tiny_engine)
    config = LmtpConfig(limits=ConnectionLimits(max_pending=2000))
    sessions = SessionStore(status.serving_engine)
    runner = web.AppRunner(make_app(status, config, sessions))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tcp_port = free_port()
    tcp = await start_tcp_server(status, config, sessions, "127.0.0.1", tcp_port)
    yield LmtpServer(tiny_engine, status, sessions, f"http://127.0.0.1:{port}/", tcp_port)
    tcp.close()
    await runner.cleanup()


@dataclass
class Client:
    """A minimal LMTP client that keeps every frame, to check framing as well as content."""

    ws: aiohttp.ClientWebSocketResponse
    frames: list[tuple[str, list[dict]]] = field(default_factory=list)
    streams: dict[int, asyncio.Queue] = field(default_factory=dict)
    messages: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def read_forever(self) -> None:
        async for message in self.ws:
            kind, payloads = parse_server_line(message.data)
            self.frames.append((kind, payloads))
            for payload in payloads:
                if kind == "TOKEN":
                    self.streams.setdefault(payload["stream_id"], asyncio.Queue()).put_nowait(payload)
                else:
                    self.messages.put_nowait(payload)

    async def send(self, line: str) -> None:
        await self.ws.send_str(line)

    async def stream(self, stream_id: int, timeout: float = 60) -> list[dict]:
        """Payloads of a stream up to and including the one that ends it."""
        queue = self.streams.setdefault(stream_id, asyncio.Queue())
        payloads = []
        while True:
            payload = await asyncio.wait_for(queue.get(), timeout)
            payloads.append(payload)
            if payload.get("error") is not None or payload.get("finish_reason") is not None:
                return payloads


@pytest_asyncio.fixture
async def connect(lmtp_server: LmtpServer):
    sessions, tasks = [], []

    async def open_client() -> Client:
        session = aiohttp.ClientSession()
        sessions.append(session)
        client = Client(await session.ws_connect(lmtp_server.url))
        tasks.append(asyncio.create_task(client.read_forever()))
        return client

    yield open_client
    for task in tasks:
        task.cancel()
    for session in sessions:
        await session.close()
