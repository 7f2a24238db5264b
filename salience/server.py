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
from dataclasses import dataclass

from aiohttp import web

from salience.core.engine import Engine
from salience.core.settings import EngineSettings
from salience.core.status import ServerStatus
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
    model_aliases: tuple[str, ...] = ()


async def serve(settings: EngineSettings, options: ServeOptions) -> None:
    """Run until SIGINT/SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    status = ServerStatus(settings.served_model_name)
    names = frozenset({settings.served_model_name, settings.model.name, *options.model_aliases})
    lmtp = LmtpConfig(model_names=names)
    runner = web.AppRunner(make_app(status, lmtp), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.lmtp_port)
    await site.start()
    log.info("listening", extra={"lmtp": f"ws://{options.host}:{options.lmtp_port}/", "phase": "loading"})
    tcp = None
    if options.lmtp_tcp_port is not None:
        tcp = await start_tcp_server(status, lmtp, options.host, options.lmtp_tcp_port)
        log.info("listening", extra={"lmtp_tcp": f"{options.host}:{options.lmtp_tcp_port}"})

    engine: Engine | None = None
    loading = asyncio.create_task(Engine.start(settings))
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({loading, stopped}, return_when=asyncio.FIRST_COMPLETED)
        # A load cannot be interrupted halfway (it runs in a thread): let it finish, then stop.
        engine = await loading
        if not stop.is_set():
            status.ready(engine)
            log.info("ready", extra={"model": settings.served_model_name, "max_model_len": engine.max_model_len})
            await stopped
        log.info("stopping")
    finally:
        stopped.cancel()
        status.stopping()
        if tcp is not None:
            tcp.close()
        await runner.cleanup()
        if engine is not None:
            engine.shutdown()
        log.info("stopped")
