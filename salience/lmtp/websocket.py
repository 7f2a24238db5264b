"""LMTP over WebSocket: the route at `/` (`add_routes`), one connection's session driven over its
frames (`serve_session`, which the TCP listener shares), and the sockets closed at shutdown. The
HTTP application that composes it with the other frontends is salience.http_app."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

from aiohttp import WSCloseCode, WSMsgType, web

from salience import metrics, request_ids
from salience.auth import Identity
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.errors import InvalidArgument
from salience.lmtp.session import OVERSIZED_FRAME, UNAUTHORIZED, LmtpConfig, LmtpSession
from salience.ui import UI_PATH

__all__ = ["AUTH_CLOSE_CODE", "LINGER_SECONDS", "LMTP_CONFIG", "SESSIONS", "STATUS", "add_routes", "serve_session"]

STATUS = web.AppKey("status", ServerStatus)
AUTH_CLOSE_CODE = 4401  # WebSocket close code for a missing or wrong token (4000-4999: application codes)


LMTP_CONFIG = web.AppKey("lmtp_config", LmtpConfig)
SESSIONS = web.AppKey("sessions", SessionStore)
SOCKETS = web.AppKey("sockets", weakref.WeakSet[web.WebSocketResponse])
CONNECTIONS = web.AppKey("connections", weakref.WeakSet[LmtpSession])
LINGER_SECONDS = 5.0  # how long a connection closed mid-frame reads on, for its close to arrive


class LingeringWebSocket(web.WebSocketResponse):
    """Closes after an oversized frame without a reset, so the client sees 1009.

    aiohttp stops at the frame's header, writes the 1009 close frame and closes the socket while
    the rest of the frame is still arriving; closing a socket with unread data makes the kernel
    send a reset, and a reset discards the close frame at the client before it is read (1006, or
    a failed send). Instead this sends FIN after the close frame and keeps the socket reading
    (aiohttp's protocol drops what arrives once the reader has failed) until the client closes or
    LINGER_SECONDS pass. `close()`, which `receive()` awaits, returns only then, because the
    request handler closes the socket when the handler returns.
    """

    _close_code_sent: int | None = None
    _linger: asyncio.Task[None] | None = None

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        if not self.closed:
            self._close_code_sent = code
        closed = await super().close(code=code, message=message, drain=drain)
        if self._linger is not None:
            await self._linger
        return closed

    def _close_transport(self) -> None:
        transport = self._req.transport if self._req is not None else None
        if self._close_code_sent != WSCloseCode.MESSAGE_TOO_BIG or transport is None or self._linger is not None:
            super()._close_transport()
            return
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()
        self._linger = asyncio.get_running_loop().create_task(_close_when_peer_closes(transport))


async def _close_when_peer_closes(transport: asyncio.Transport) -> None:
    # The transport closes itself on the peer's FIN; nothing else signals that, so poll.
    deadline = asyncio.get_running_loop().time() + LINGER_SECONDS
    while not transport.is_closing() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    transport.close()


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
        # What is queued (such as the error that ended the input) goes out first; to a client
        # that has gone, sending fails at once.
        await asyncio.wait({pump}, timeout=5)
        watcher.cancel()
        pump.cancel()
        await asyncio.gather(pump, watcher, return_exceptions=True)


async def lmtp_websocket(request: web.Request) -> web.StreamResponse:
    # Messages up to the frame ceiling are read, so one over the message limit costs only itself.
    ws = LingeringWebSocket(max_msg_size=request.app[LMTP_CONFIG].limits.max_frame_bytes)
    if not ws.can_prepare(request).ok:
        raise web.HTTPFound(UI_PATH)  # a browser opening the server's address gets the page
    prefix = request.headers.get(request_ids.HEADER)
    if prefix is not None:  # browsers cannot set it, so refusing before the upgrade is fine
        try:
            request_ids.check(prefix, "the x-request-id header")
        except InvalidArgument as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None
    await ws.prepare(request)
    config = request.app[LMTP_CONFIG]
    identity = Identity(config.tokens, request.headers.get("Authorization"), request.query.get("token"), request.remote)
    if identity.client is None:
        # Close after the upgrade, not a 401 before it: browsers see close codes, never HTTP statuses.
        metrics.AUTH_FAILURES.labels("lmtp_ws").inc()
        await ws.close(code=AUTH_CLOSE_CODE, message=UNAUTHORIZED.encode())
        return ws
    request.app[SOCKETS].add(ws)
    session = LmtpSession(
        request.app[STATUS],
        config,
        request.app[SESSIONS],
        request_id_prefix=prefix,
        identity=identity,
    )
    request.app[CONNECTIONS].add(session)

    async def lines() -> AsyncIterator[str | bytes]:
        async for message in ws:
            if message.type is WSMsgType.ERROR and getattr(message.data, "code", None) == WSCloseCode.MESSAGE_TOO_BIG:
                session.dropping(OVERSIZED_FRAME)
            if message.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                # One message per frame; a frame of several lines is read line by line.
                data = message.data
                for line in data.splitlines() if ("\n" if isinstance(data, str) else b"\n") in data else (data,):
                    if line.strip():
                        yield line

    async def close() -> None:
        if session.revoked:  # a reload removed its token, and its last stream has ended
            await ws.close(code=AUTH_CLOSE_CODE, message=UNAUTHORIZED.encode())
        else:
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"client is not reading")

    await serve_session(session, lines(), ws.send_str, close)
    return ws


async def _close_sockets(app: web.Application) -> None:
    # What the connections have queued (a drain's last payloads, "stopping") goes out first.
    await asyncio.gather(*(session.flush(2.0) for session in list(app[CONNECTIONS])))
    for ws in list(app[SOCKETS]):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


def add_routes(app: web.Application, status: ServerStatus, config: LmtpConfig, sessions: SessionStore) -> None:
    """LMTP's WebSocket at `/`, on `status`'s engine, with `sessions` shared with the other frontends."""
    app[STATUS] = status
    app[LMTP_CONFIG] = config
    app[SESSIONS] = sessions
    app[SOCKETS] = weakref.WeakSet()
    app[CONNECTIONS] = weakref.WeakSet()
    app.router.add_get("/", lmtp_websocket)
    app.on_shutdown.append(_close_sockets)
