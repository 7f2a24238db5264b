"""A small asyncio LMTP client: what the REPL and benchmarks use, and what a script can copy."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any, Self

import aiohttp
import orjson

from salience.lmtp.codec import parse_server_line

__all__ = ["LmtpClient", "LmtpStreamError"]


class LmtpStreamError(Exception):
    """The server ended a stream (or answered a request) with an error."""


class LmtpClient:
    """One WebSocket connection; streams and requests are told apart by stream_id."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session: aiohttp.ClientSession) -> None:
        self._ws = ws
        self._session = session
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue[dict | None]] = {}
        self._replies: dict[int, asyncio.Future[dict]] = {}
        self._progress: dict[int, Callable[[int, int], None]] = {}  # PATCH_SWEEPs' progress callbacks
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(
        cls, url: str, headers: dict[str, str] | None = None, *, tls: ssl.SSLContext | None = None
    ) -> Self:
        """Connect to a ws:// or wss:// URL; `tls` says whom to trust (default: the system's CAs)
        and which certificate to present (ClientTls.context)."""
        session = aiohttp.ClientSession(headers=headers)
        try:
            ws = await session.ws_connect(url, max_msg_size=0, ssl=tls if tls is not None else True)
        except BaseException:
            await session.close()
            raise
        return cls(ws, session)

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._ws.close()
        await self._session.close()

    @property
    def close_code(self) -> int | None:
        """The WebSocket close code, once the connection has closed."""
        return self._ws.close_code

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                kind, payloads = parse_server_line(message.data)
                for payload in payloads:
                    self._received(kind, payload)
        finally:
            self._ended()

    def _received(self, kind: str, payload: dict) -> None:
        """Each payload the server sends, in order (a subclass may route them its own way)."""
        stream_id = payload.get("stream_id")
        if kind == "TOKEN" and stream_id in self._streams:
            self._streams[stream_id].put_nowait(payload)
        elif kind == "MSG" and "progress" in payload:  # a PATCH_SWEEP's, before its reply
            if stream_id in self._progress:
                self._progress[stream_id](payload["progress"]["done"], payload["progress"]["total"])
        elif kind == "MSG" and stream_id in self._replies:
            self._replies.pop(stream_id).set_result(payload)

    def _ended(self) -> None:
        """The connection has closed, or the client was closed: whoever waits is told."""
        for queue in self._streams.values():
            queue.put_nowait(None)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(ConnectionError("connection closed"))

    async def _send(self, kind: str, payload: dict[str, Any]) -> None:
        await self.send_lines(kind + " " + orjson.dumps(payload).decode())

    async def send_lines(self, *lines: str) -> None:
        """Lines as they are, in one frame: several messages at once, or one that is malformed."""
        await self._ws.send_str("\n".join(lines))

    async def request(self, kind: str, **fields: Any) -> dict:
        """Send a message answered by one MSG payload (MODEL_INFO, TOKENIZE, ...)."""
        return await self._ask(kind, fields)

    async def sweep(self, progress: Callable[[int, int], None] | None = None, **fields: Any) -> dict:
        """Run a PATCH_SWEEP (docs/patching.md) and return its grid; `progress(done, total)` is
        called as the server tells it. Cancelling the call cancels the sweep."""
        stream_id = self.next_stream_id()
        if progress is not None:
            self._progress[stream_id] = progress
        try:
            return (await self._ask("PATCH_SWEEP", fields, stream_id))["sweep"]
        except asyncio.CancelledError:
            await self.cancel(stream_id)
            raise
        finally:
            self._progress.pop(stream_id, None)

    async def _ask(self, kind: str, fields: dict[str, Any], stream_id: int | None = None) -> dict:
        stream_id = stream_id if stream_id is not None else self.next_stream_id()
        future = asyncio.get_running_loop().create_future()
        self._replies[stream_id] = future
        try:
            await self._send(kind, {"stream_id": stream_id, **fields})
            reply = await future
        finally:
            self._replies.pop(stream_id, None)
        if reply.get("error"):
            raise LmtpStreamError(reply["error"])
        return reply

    def next_stream_id(self) -> int:
        return next(self._ids)

    async def stream(self, kind: str, *, stream_id: int | None = None, **fields: Any) -> AsyncIterator[dict]:
        """Send GENERATE or SCORE and yield its TOKEN payloads; the last has a finish_reason."""
        stream_id = stream_id if stream_id is not None else self.next_stream_id()
        queue: asyncio.Queue[dict | None] = asyncio.Queue()
        self._streams[stream_id] = queue
        await self._send(kind, {"stream_id": stream_id, **fields})
        try:
            while (payload := await queue.get()) is not None:
                if payload.get("error"):
                    raise LmtpStreamError(payload["error"])
                yield payload
                if payload.get("finish_reason"):
                    return
            raise ConnectionError("connection closed mid-stream")
        finally:
            del self._streams[stream_id]

    async def cancel(self, stream_id: int) -> None:
        await self._send("CANCEL", {"stream_id": stream_id})
