"""A connection's outbound queue: payloads waiting for the client, sent in as few frames as keep
each stream's order (one frame per run of the same type: tokens of different streams that are
ready together share a frame)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

from salience.lmtp.codec import msg_frame, token_frame

__all__ = ["Outbox"]


class Outbox:
    def __init__(self, max_pending: int, send_timeout: float) -> None:
        self.max_pending = max_pending  # payloads that may wait for a client that does not read
        self.send_timeout = send_timeout  # seconds one frame may take to go out
        self._queue: deque[tuple[str, dict]] = deque()
        self._wake = asyncio.Event()
        self._sending = False  # a frame is on its way out
        self._closed = False

    def __len__(self) -> int:
        return len(self._queue)

    def full(self) -> bool:
        return len(self._queue) >= self.max_pending

    def put(self, kind: str, payload: dict) -> None:
        """Queue a payload of `kind` ("TOKEN" or "MSG"); after close, dropped."""
        if not self._closed:
            self._queue.append((kind, payload))
            self._wake.set()

    def close(self) -> None:
        """Take nothing more; `pump` sends what is queued, then returns."""
        self._closed = True
        self._wake.set()

    async def pump(self, send: Callable[[str], Awaitable[None]]) -> bool:
        """Send until closed and empty: True then, False if a frame took longer than the timeout."""
        while True:
            if not self._queue:
                if self._closed:
                    return True
                self._wake.clear()
                await self._wake.wait()
                continue
            kind, run = self._queue[0][0], []
            while self._queue and self._queue[0][0] == kind:
                run.append(self._queue.popleft()[1])
            frame = token_frame(run) if kind == "TOKEN" else msg_frame(run)
            try:
                self._sending = True
                await asyncio.wait_for(send(frame), self.send_timeout)
            except TimeoutError:
                return False
            finally:
                self._sending = False

    async def flush(self, timeout: float) -> None:
        """Until what is queued has been sent (or the outbox closed), for up to `timeout` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while (self._queue or self._sending) and not self._closed:
                    await asyncio.sleep(0.01)
