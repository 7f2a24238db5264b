"""LMTP over plain TCP: one message per line, so `nc` or any socket library can talk."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

from salience.auth import Identity
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.lmtp.session import OVERSIZED_FRAME, LmtpConfig, LmtpSession
from salience.lmtp.websocket import LINGER_SECONDS, serve_session

__all__ = ["start_tcp_server"]


async def start_tcp_server(
    status: ServerStatus,
    config: LmtpConfig,
    sessions: SessionStore,
    host: str,
    port: int,
    context: ssl.SSLContext | None = None,
) -> asyncio.Server:
    """Listen on host:port, behind TLS with `context`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        # No token travels over TCP: the peer alone, the anonymous client of an open server (which
        # `serve` requires) and nobody on one that requires a token (every message refused).
        identity = Identity(config.tokens, peer=peer[0] if peer else None)
        session = LmtpSession(status, config, sessions, frontend="lmtp_tcp", identity=identity)
        overrun = False

        async def lines() -> AsyncIterator[bytes]:
            nonlocal overrun
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:
                    if exc.partial.strip():
                        yield exc.partial
                    return
                except asyncio.LimitOverrunError:
                    overrun = True
                    session.dropping(OVERSIZED_FRAME)
                    limit = config.limits.max_frame_bytes
                    session.reject(f"message exceeds the hard limit of {limit} bytes (--lmtp-max-frame-bytes); closing")
                    return
                if line.strip():
                    yield line

        async def send(frame: str) -> None:
            writer.write(frame.encode() + b"\n")
            await writer.drain()

        async def close() -> None:
            if not overrun:  # after an overrun, the `finally` below closes
                writer.close()

        try:
            await serve_session(session, lines(), send, close)
        finally:
            if overrun:
                await _linger(reader, writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    # readuntil accepts a line whose content (before the newline) is at most `limit` bytes.
    return await asyncio.start_server(handle, host, port, limit=config.limits.max_frame_bytes, ssl=context)


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After the error for an over-ceiling line: FIN, then read and drop the rest of the line.

    Closing a socket with unread data makes the kernel send a reset, which discards the error
    line at the client before it is read; so read on until the client closes, for at most
    LINGER_SECONDS, as the WebSocket does (salience.lmtp.websocket.LingeringWebSocket).
    """
    with contextlib.suppress(OSError, TimeoutError):
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(LINGER_SECONDS):
            while await reader.read(2**16):
                pass
