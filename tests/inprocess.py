"""Salience's frontends in the test's process, on an engine the test started: LMTP over
WebSocket (with /health and /metrics), gRPC, and optionally LMTP over TCP, as `salience serve`
wires them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.grpc_frontend.server import start_grpc_server
from salience.http_app import make_app
from salience.lmtp.session import LmtpConfig
from salience.lmtp.tcp import start_tcp_server
from tests.conftest import free_port


@dataclass(frozen=True)
class Frontends:
    status: ServerStatus
    port: int  # the WebSocket's, /health's and /metrics'
    grpc_target: str
    tcp_port: int | None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"


@asynccontextmanager
async def frontends(
    engine: Engine,
    name: str = "tiny",
    *,
    lmtp: LmtpConfig | None = None,
    tcp: LmtpConfig | None = None,
    grpc_tokens: Tokens | None = None,
) -> AsyncIterator[Frontends]:
    """Serve `engine` as model `name`; LMTP over TCP only with a `tcp` config. The sessions are shared."""
    status = ServerStatus(name)
    status.ready(engine)
    sessions = SessionStore(status.serving_engine)
    runner = web.AppRunner(make_app(status, lmtp or LmtpConfig(), sessions))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tcp_port = free_port() if tcp is not None else None
    tcp_server = await start_tcp_server(status, tcp, sessions, "127.0.0.1", tcp_port) if tcp_port else None
    grpc_server = await start_grpc_server(status, sessions, "127.0.0.1", 0, grpc_tokens)
    await grpc_server.serving(True)
    try:
        yield Frontends(status, port, f"127.0.0.1:{grpc_server.port}", tcp_port)
    finally:
        await grpc_server.stop(0)
        if tcp_server is not None:
            tcp_server.close()
        await runner.cleanup()
