"""LMTP over plain TCP: one message per line, so `nc` or any socket library can talk."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from salience.core.sessions import SessionStore
from salience.core.status import ServerStatus
from salience.lmtp.app import serve_session
from salience.lmtp.session import OVERSIZED_FRAME, LmtpConfig, LmtpSession

__all__ = ["start_tcp_server"]


async def start_tcp_server(
    status: ServerStatus, config: LmtpConfig, sessions: SessionStore, host: str, port: int
) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = LmtpSession(status, config, sessions, frontend="lmtp_tcp")

        async def lines() -> AsyncIterator[bytes]:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as exc:
                    if exc.partial.strip():
                        yield exc.partial
                    return
                except asyncio.LimitOverrunError:
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
            writer.close()

        try:
            await serve_session(session, lines(), send, close)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    # readuntil accepts a line whose content (before the newline) is at most `limit` bytes.
    return await asyncio.start_server(handle, host, port, limit=config.limits.max_frame_bytes)
