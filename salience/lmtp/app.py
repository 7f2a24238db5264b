"""The aiohttp application: LMTP over WebSocket at `/`, `GET /health`, and the browser page at `/ui/`."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

from aiohttp import WSCloseCode, WSMsgType, web

from salience.auth import bearer_matches
from salience.core.sessions import SessionStore
from salience.core.status import Phase, ServerStatus
from salience.lmtp.codec import MAX_LINE_BYTES
from salience.lmtp.session import LmtpConfig, LmtpSession
from salience.ui import UI_PATH, add_routes

__all__ = ["LMTP_CONFIG", "STATUS", "make_app", "serve_session"]

STATUS = web.AppKey("status", ServerStatus)
AUTH_CLOSE_CODE = 4401  # WebSocket close code for a missing or wrong token (4000-4999: application codes)


LMTP_CONFIG = web.AppKey("lmtp_config", LmtpConfig)
SESSIONS = web.AppKey("sessions", SessionStore)
SOCKETS = web.AppKey("sockets", weakref.WeakSet[web.WebSocketResponse])


async def health(request: web.Request) -> web.Response:
    """200 once the engine is loaded and warmed up; 503 while loading or stopping."""
    status = request.app[STATUS]
    body = {"status": status.phase.value, "model": status.model_name}
    return web.json_response(body, status=200 if status.phase is Phase.READY else 503)


async def serve_session(session: LmtpSession, lines: AsyncIterator[str | bytes], send, close) -> None:
    """Drive one session over any line transport; the caller owns the transport."""
    pump = asyncio.create_task(session.pump(send))

    async def close_when_session_closes() -> None:
        await session.closed.wait()
        # Give queued errors a moment to go out before the transport closes.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(pump), 5)
        await close()

    watcher = asyncio.create_task(close_when_session_closes())
    try:
        async for line in lines:
            session.receive(line)
    finally:
        session.close()
        await session.wait_closed()
        watcher.cancel()
        pump.cancel()
        await asyncio.gather(pump, watcher, return_exceptions=True)


async def lmtp_websocket(request: web.Request) -> web.StreamResponse:
    ws = web.WebSocketResponse(max_msg_size=MAX_LINE_BYTES)
    if not ws.can_prepare(request).ok:
        raise web.HTTPFound(UI_PATH)  # a browser opening the server's address gets the page
    await ws.prepare(request)
    config = request.app[LMTP_CONFIG]
    if config.auth_token and not bearer_matches(
        config.auth_token, request.headers.get("Authorization"), request.query.get("token")
    ):
        # Close after the upgrade, not a 401 before it: browsers see close codes, never HTTP statuses.
        await ws.close(code=AUTH_CLOSE_CODE, message=b"unauthorized: missing or wrong token")
        return ws
    request.app[SOCKETS].add(ws)
    session = LmtpSession(request.app[STATUS], config, request.app[SESSIONS])

    async def lines() -> AsyncIterator[str | bytes]:
        async for message in ws:
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                # One message per frame; a frame of several lines is read line by line.
                data = message.data
                for line in data.splitlines() if ("\n" if isinstance(data, str) else b"\n") in data else (data,):
                    if line.strip():
                        yield line

    async def close() -> None:
        await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"client is not reading")

    await serve_session(session, lines(), ws.send_str, close)
    return ws


async def _close_sockets(app: web.Application) -> None:
    for ws in list(app[SOCKETS]):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


def make_app(status: ServerStatus, config: LmtpConfig, sessions: SessionStore | None = None) -> web.Application:
    """The app; `sessions` is shared with the other frontends (by default the app has its own)."""
    app = web.Application()
    app[STATUS] = status
    app[LMTP_CONFIG] = config
    app[SESSIONS] = sessions if sessions is not None else SessionStore(status.serving_engine)
    app[SOCKETS] = weakref.WeakSet()
    app.router.add_get("/", lmtp_websocket)
    app.router.add_get("/health", health)
    add_routes(app)
    app.on_shutdown.append(_close_sockets)
    return app
