"""One LMTP WebSocket that routes every payload, errors and strays included, and one stream read to its end."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from salience.lmtp.client import LmtpClient

Item = tuple[str, dict, float]  # frame type, payload, arrival (loop time)


class Connection(LmtpClient):
    """An LmtpClient that routes every payload: to its stream_id's queue (errors included, with
    the time it arrived), MSG errors without one to `anonymous`, anything for an unrouted id kept
    as a stray. A close this side did not ask for is recorded in `dropped`."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session: aiohttp.ClientSession) -> None:
        self._routes: dict[int, asyncio.Queue[Item | None]] = {}
        self._send_lock = asyncio.Lock()
        self.anonymous: asyncio.Queue[Item | None] = asyncio.Queue()
        self.anonymous_lock = asyncio.Lock()  # one bad input awaiting an anonymous error at a time
        self.strays: list[Item] = []
        self.closing = False
        self.dropped: str | None = None
        super().__init__(ws, session)

    @classmethod
    async def open(cls, url: str, token: str | None, tls: ssl.SSLContext | None = None) -> Connection:
        return await cls.connect(url, {"Authorization": f"Bearer {token}"} if token else None, tls=tls)

    @property
    def closed(self) -> bool:
        return self._reader.done()

    async def wait_closed(self, timeout: float) -> bool:
        """Until the server closes the connection; False if it is still open after `timeout` s."""
        done, _ = await asyncio.wait({self._reader}, timeout=timeout)
        return bool(done)

    def route(self, stream_id: int) -> asyncio.Queue[Item | None]:
        queue: asyncio.Queue[Item | None] = asyncio.Queue()
        if self.closed:
            queue.put_nowait(None)
        self._routes[stream_id] = queue
        return queue

    def unroute(self, stream_id: int) -> None:
        """Stop routing `stream_id`; what arrived for it after its end is kept as a stray."""
        queue = self._routes.pop(stream_id, None)
        while queue is not None and not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                self.strays.append(item)

    async def send(self, *lines: str) -> None:
        """The lines in one frame. A connection that has gone shows in `dropped` and in every
        route's queue, so a send that fails is left to them."""
        async with self._send_lock:
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await self.send_lines(*lines)

    def _received(self, kind: str, payload: dict) -> None:
        item = (kind, payload, asyncio.get_running_loop().time())
        stream_id = payload.get("stream_id")
        if stream_id is None and kind == "MSG":
            self.anonymous.put_nowait(item)
        elif stream_id in self._routes:
            self._routes[stream_id].put_nowait(item)
        else:
            self.strays.append(item)

    def _ended(self) -> None:
        if not self.closing:
            self.dropped = f"closed by the server (code {self.close_code}, {self._ws.exception() or 'no error'})"
        for queue in [*self._routes.values(), self.anonymous]:
            queue.put_nowait(None)
        super()._ended()

    async def close(self) -> None:
        self.closing = True
        await super().close()


def line(kind: str, payload: dict) -> str:
    return kind + " " + orjson.dumps(payload).decode()


@dataclass
class Received:
    """What arrived for one stream, up to its terminal payload."""

    tokens: list[dict] = field(default_factory=list)  # payloads with a token, prompt positions aside
    prompt: list[dict] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # of each token payload, loop time
    errors: list[tuple[str, str]] = field(default_factory=list)  # (frame type, message)
    finish: str | None = None
    finished_at: float | None = None  # arrival of the terminal payload, loop time
    request_id: str | None = None  # the terminal payload's
    unnamed_errors: int = 0  # error payloads without the request_id every error must carry
    ended: str = "finished"  # finished | error | timeout | dropped

    @property
    def first_token(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    def trouble(self, timeout: float) -> str | None:
        match self.ended:
            case "timeout":
                return f"no terminal payload within {timeout:.0f} s ({len(self.tokens)} tokens)"
            case "dropped":
                return f"connection dropped after {len(self.tokens)} tokens"
            case "error":
                return f"error: {self.errors[-1][1]}"
        return None


async def receive(
    queue: asyncio.Queue[Item | None],
    timeout: float,
    *,
    on_token: Callable[[int], Awaitable[None]] | None = None,
    tolerate: Callable[[str], bool] = lambda error: False,
) -> Received:
    """Read one stream until its terminal payload, an error (unless tolerated), a drop or the timeout."""
    got = Received()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            item = await asyncio.wait_for(queue.get(), max(deadline - loop.time(), 0))
        except TimeoutError:
            got.ended = "timeout"
            return got
        if item is None:
            queue.put_nowait(None)  # for the next reader of a shared queue
            got.ended = "dropped"
            return got
        kind, payload, at = item
        if payload.get("error") is not None:
            got.errors.append((kind, str(payload["error"])))
            got.unnamed_errors += not payload.get("request_id")
            if not tolerate(str(payload["error"])):
                got.ended = "error"
                return got
            continue
        if payload.get("prompt"):
            got.prompt.append(payload)
        elif "token" in payload:
            got.tokens.append(payload)
            got.arrivals.append(at)
            if on_token is not None:
                await on_token(len(got.tokens))
        if payload.get("finish_reason") is not None:
            got.finish, got.request_id = payload["finish_reason"], payload.get("request_id")
            got.finished_at = at
            return got
