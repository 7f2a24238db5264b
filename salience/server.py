"""Composition root: one engine, every frontend, one lifecycle.

Frontends start first and answer "loading" while the model loads; the engine
is then loaded and warmed up, and only then is the server ready. SIGINT and
SIGTERM stop the frontends, end in-flight streams and shut the engine
processes down before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field

from aiohttp import web

from salience.core.engine import Engine
from salience.core.sessions import SessionLimits, SessionStore
from salience.core.settings import EngineSettings
from salience.core.status import ServerStatus
from salience.errors import InvalidArgument
from salience.grpc_frontend.server import start_grpc_server
from salience.lmtp.app import make_app
from salience.lmtp.session import LmtpConfig
from salience.lmtp.tcp import start_tcp_server

__all__ = ["ServeOptions", "serve"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServeOptions:
    host: str = "127.0.0.1"
    lmtp_port: int = 8080
    lmtp_tcp_port: int | None = None
    grpc_port: int | None = 50051
    model_aliases: tuple[str, ...] = ()
    auth_token: str | None = None
    sessions: SessionLimits = field(default_factory=SessionLimits)


async def serve(settings: EngineSettings, options: ServeOptions) -> None:
    """Run until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    status = ServerStatus(settings.served_model_name, {settings.model.name, *options.model_aliases})
    if options.auth_token is None:
        log.warning("no auth token configured: every client that can reach the ports may use the server")
    elif options.lmtp_tcp_port is not None:
        raise InvalidArgument(
            "--lmtp-tcp-port cannot carry a token: serve it without --auth-token, or use the WebSocket"
        )
    lmtp = LmtpConfig(auth_token=options.auth_token)
    sessions = SessionStore(status.serving_engine, options.sessions)
    sweeper = asyncio.create_task(sessions.sweep_forever())
    runner = web.AppRunner(make_app(status, lmtp, sessions), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.lmtp_port)
    await site.start()
    log.info("listening", extra={"lmtp": f"ws://{options.host}:{options.lmtp_port}/", "phase": "loading"})
    tcp = None
    if options.lmtp_tcp_port is not None:
        tcp = await start_tcp_server(status, lmtp, sessions, options.host, options.lmtp_tcp_port)
        log.info("listening", extra={"lmtp_tcp": f"{options.host}:{options.lmtp_tcp_port}"})
    grpc = None
    if options.grpc_port is not None:
        grpc = await start_grpc_server(status, sessions, options.host, options.grpc_port, options.auth_token)
        log.info("listening", extra={"grpc": f"{options.host}:{grpc.port}"})

    engine: Engine | None = None
    loading = asyncio.create_task(Engine.start(settings))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        # A load cannot be interrupted halfway (it runs in a thread): let it finish, then stop.
        engine = await loading
        if not stop.is_set():
            status.ready(engine)
            if grpc is not None:
                await grpc.serving(True)
            log.info("ready", extra={"model": settings.served_model_name, "max_model_len": engine.max_model_len})
            await stopped
        log.info("stopping")
    finally:
        stopped.cancel()
        sweeper.cancel()
        status.stopping()
        if tcp is not None:
            tcp.close()
        if grpc is not None:
            await grpc.stop()
        await runner.cleanup()
        if engine is not None:
            engine.shutdown()
        log.info("stopped")
