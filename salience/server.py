"""Composition root: one engine, every frontend, one lifecycle.

Frontends start first and answer "loading" while the model loads; the engine
is then loaded and warmed up, and only then is the server ready.

SIGTERM drains: new streams and sessions are refused at once (health reports
it, so a load balancer moves traffic), the streams in flight run to their end
for up to `drain_timeout` seconds, and what is left is then cancelled, each
stream ending with finish reason "cancelled". SIGINT, or a second SIGTERM,
skips the wait. Either way the frontends close and the engine processes shut
down before the process exits.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings
from salience.core.serving.sessions import SessionLimits, SessionStore
from salience.core.serving.status import ServerStatus
from salience.errors import InvalidArgument
from salience.grpc_frontend.server import GrpcServer, start_grpc_server
from salience.http_app import make_app, make_metrics_app
from salience.lmtp.config import check_tcp_auth
from salience.lmtp.session import ConnectionLimits, LmtpConfig
from salience.lmtp.tcp import start_tcp_server
from salience.tls import ServerTls
from salience.token_file import load_token_file

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
    admin_token: str | None = None  # the operator's: every scope
    tokens_file: Path | None = None  # named clients with scopes and limits (token_file.py); SIGHUP reloads it
    sessions: SessionLimits = field(default_factory=SessionLimits)
    lmtp_limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # message size limits and more
    metrics_port: int | None = None  # GET /metrics without auth, for a private network
    drain_timeout: float = 30.0  # seconds in-flight streams get after SIGTERM
    tls: ServerTls | None = None  # every port behind TLS (mutual with a client CA); SIGHUP reloads it


# After the drain (or at once), cancelled streams get this long to send their last payloads.
_LAST_WORDS = 2.0


async def serve(settings: EngineSettings, options: ServeOptions) -> None:
    """Run until SIGTERM (drain, then stop) or SIGINT (stop now)."""
    loop = asyncio.get_running_loop()
    drain = asyncio.Event()
    stop = asyncio.Event()

    def on_sigterm() -> None:
        (stop if drain.is_set() else drain).set()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    tls = options.tls
    context = tls.context if tls is not None else None
    secure = "s" if tls is not None else ""

    status = ServerStatus(settings.served_model_name, {settings.model.name, *options.model_aliases})
    tokens = _tokens(options)
    check_tcp_auth(tokens.required, options.lmtp_tcp_port)
    loop.add_signal_handler(signal.SIGHUP, functools.partial(_reload, tls, tokens, options.tokens_file))
    if not tokens.required:
        log.warning("no auth token configured: every client that can reach the ports may use the server")
        if options.admin_token is None:
            log.warning("no admin token configured: every client may define, delete and save live concepts")
    lmtp = LmtpConfig(tokens=tokens, limits=options.lmtp_limits)
    sessions = SessionStore(status.serving_engine, options.sessions)
    sweeper = asyncio.create_task(sessions.sweep_forever())
    runner = web.AppRunner(make_app(status, lmtp, sessions), access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, options.host, options.lmtp_port, ssl_context=context).start()
    where = f"{options.host}:{options.lmtp_port}"
    urls = {"lmtp": f"ws{secure}://{where}/", "openai": f"http{secure}://{where}/v1"}
    log.info("listening", extra={**urls, "phase": "loading", "tls": _tls_mode(tls)})
    metrics_runner = None
    if options.metrics_port is not None:
        metrics_runner = web.AppRunner(make_metrics_app(), access_log=None, handle_signals=False)
        await metrics_runner.setup()
        await web.TCPSite(metrics_runner, options.host, options.metrics_port, ssl_context=context).start()
        log.info("listening", extra={"metrics": f"http{secure}://{options.host}:{options.metrics_port}/metrics"})
    tcp = None
    if options.lmtp_tcp_port is not None:
        tcp = await start_tcp_server(status, lmtp, sessions, options.host, options.lmtp_tcp_port, context)
        log.info("listening", extra={"lmtp_tcp": f"{options.host}:{options.lmtp_tcp_port}"})
    grpc = None
    if options.grpc_port is not None:
        credentials = tls.grpc_credentials() if tls is not None else None
        grpc = await start_grpc_server(status, sessions, options.host, options.grpc_port, tokens, credentials)
        log.info("listening", extra={"grpc": f"{options.host}:{grpc.port}"})

    engine: Engine | None = None
    loading = asyncio.create_task(Engine.start(settings))
    signalled = asyncio.create_task(_either(drain, stop))
    try:
        await asyncio.wait({loading, signalled}, return_when=asyncio.FIRST_COMPLETED)
        # A load cannot be interrupted halfway (it runs in a thread): let it finish, then stop.
        engine = await loading
        if not signalled.done():
            status.ready(engine)
            if grpc is not None:
                await grpc.serving(True)
            log.info("ready", extra={"model": settings.served_model_name, "max_model_len": engine.max_model_len})
            await signalled
            if not stop.is_set():
                await _drain(status, grpc, stop, options.drain_timeout)
        log.info("stopping")
    finally:
        signalled.cancel()
        sweeper.cancel()
        if engine is not None and await engine.cancel_all():
            await status.wait_idle(_LAST_WORDS)  # their last payloads ("cancelled") are queued
        status.stopping()  # LMTP connections send what is queued, then close
        if tcp is not None:
            tcp.close()
        if grpc is not None:
            await grpc.stop()
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        if engine is not None:
            engine.shutdown()
        log.info("stopped")


def _tokens(options: ServeOptions) -> Tokens:
    """The server's clients. A tokens file requires a token even while it names no client (as the
    command line's checks assume): a reload that fills it must not find the server open."""
    clients = load_token_file(options.tokens_file) if options.tokens_file is not None else ()
    return Tokens(options.auth_token, options.admin_token, clients, required=options.tokens_file is not None)


def _reload(tls: ServerTls | None, tokens: Tokens, tokens_file: Path | None) -> None:
    """SIGHUP: the certificate and the tokens file, read again; a file that fails its checks is
    logged and leaves what is served as it was. Open connections follow the new clients
    (Tokens.reload tells them; docs/security.md#tokens-and-scopes)."""
    if tls is not None:
        tls.reload()
    if tokens_file is not None:
        try:
            tokens.reload(load_token_file(tokens_file))
        except InvalidArgument as exc:
            log.error("tokens reload failed; the clients stay as they were", extra={"reason": str(exc)})
            return
        log.info("tokens reloaded", extra={"clients": len(tokens.clients)})


def _tls_mode(tls: ServerTls | None) -> str:
    return "off" if tls is None else "mutual" if tls.mutual else "on"


async def _either(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def _drain(status: ServerStatus, grpc: GrpcServer | None, stop: asyncio.Event, timeout: float) -> None:
    """Refuse new work at once; let the streams in flight finish, for up to `timeout` seconds
    or until `stop` is set."""
    status.draining()
    if grpc is not None:
        await grpc.serving(False)
    log.info("draining", extra={"in_flight": status.in_flight, "timeout": timeout})
    idle = asyncio.create_task(status.wait_idle())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({idle, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    idle.cancel()
    stopped.cancel()
    if status.in_flight:
        why = "signal" if stop.is_set() else "timeout"
        log.info("drain cut short: cancelling what is left", extra={"in_flight": status.in_flight, "cause": why})
