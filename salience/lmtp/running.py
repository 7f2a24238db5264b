"""A connection's running streams, from request to end: each one's admission, task, id and CANCEL.

A CANCEL can come at any moment of a stream's life, even in the frame that
started it, before its task has run: it is remembered on the stream, cancels
the stream's work if it exists, and otherwise cancels it as it is attached
(streams.py), before anything has reached the engine.

A stream's id is taken from its request until its terminal payload (or error)
goes out; from then on a CANCEL for it gets "not running" and a new request may
reuse the id, even while the old task winds down.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine

import orjson

from salience import metrics
from salience.auth import Client
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import Admitted, ServerStatus
from salience.errors import SalienceError
from salience.lmtp import streams
from salience.lmtp.messages import Generate, Score, SessionGenerate
from salience.lmtp.streams import Stream
from salience.lmtp.terms import wire_field
from salience.logs import REQUEST_ID

__all__ = ["RunningStreams"]

log = logging.getLogger(__name__)

_KINDS = {Generate: "generate", Score: "score", SessionGenerate: "session_generate"}


class RunningStreams:
    """One connection's streams (LmtpSession holds one); it reaches the session only through
    the callables it is given."""

    def __init__(
        self,
        status: ServerStatus,
        sessions: SessionStore,
        frontend: str,
        *,
        put: Callable[[str, dict], None],
        error: Callable[..., None],
        spawn: Callable[[Coroutine[object, object, None], str | None], None],
        closed: asyncio.Event,
        ended: Callable[[], None],
    ) -> None:
        """The connection's parts a stream reaches: `put` queues a payload, `error` ends a stream
        with an error payload, `spawn` runs a CANCEL's work, `closed` is set once nothing more goes
        out, and `ended` is told each time a stream's task has ended."""
        self._status = status
        self._sessions = sessions
        self._frontend = frontend
        self._put = put
        self._error = error
        self._spawn = spawn
        self._closed = closed
        self._ended = ended
        self._readout_positions = metrics.READOUT_POSITIONS.labels(frontend)
        self._readout_bytes = metrics.READOUT_BYTES.labels(frontend)
        self._streams: dict[int, Stream] = {}  # by id: those whose terminal payload has yet to go out
        self._live: set[Stream] = set()  # every stream whose task has yet to end

    def __len__(self) -> int:
        """Streams whose terminal payload has yet to go out."""
        return len(self._streams)

    def get(self, stream_id: int | None) -> Stream | None:
        """The stream that holds `stream_id` now, if one does."""
        return self._streams.get(stream_id)

    @property
    def idle(self) -> bool:
        """No stream's task is left."""
        return not self._live

    def start(self, request: Generate | Score | SessionGenerate, request_id: str, client: Client) -> None:
        stream_id = request.stream_id
        if stream_id in self._streams:
            message = f"stream_id {stream_id} is already running on this connection"
            self._error(stream_id, message, request_id=request_id)
            return
        try:
            self._status.serving_engine()
            self._status.check_model(getattr(request, "model", None))
            admitted = self._status.admit(self._frontend, _KINDS[type(request)], **client.admission())
        except SalienceError as exc:
            kind = type(exc).__name__
            field = wire_field(exc.field)
            self._error(stream_id, str(exc), kind=kind, request_id=request_id, retry_after=exc.retry_after, field=field)
            return
        stream = Stream(stream_id, request_id, client)
        emit, engine = functools.partial(self._token, stream), admitted.engine
        # The coroutine is made when the task first runs: one made here and never awaited, because
        # the client left before the task ran, would be reported ("never awaited") on stderr.
        match request:
            case Generate():
                work = functools.partial(streams.generate, stream, engine, request, emit)
            case Score():
                work = functools.partial(streams.score, stream, engine, request, emit)
            case SessionGenerate():
                work = functools.partial(streams.session_generate, stream, engine, request, emit, self._sessions)
        stream.task = asyncio.create_task(self._guard(stream, admitted, work))
        self._streams[stream_id] = stream
        self._live.add(stream)
        stream.task.add_done_callback(lambda _: self._forget(stream, admitted))

    def cancel(self, stream_id: int) -> None:
        # Every CANCEL either ends its stream "cancelled" or gets this error.
        stream = self._streams.get(stream_id)
        if stream is None:
            self._error(stream_id, f"CANCEL: stream {stream_id} is not running")
        elif not stream.cancelled:
            stream.cancelled = True
            if stream.work is not None:
                self._spawn(stream.work.cancel(), stream.request_id)

    def end_all(self, message: str, kind: str) -> None:
        """End every stream with an error and cancel every task (the connection is closing)."""
        for stream in list(self._streams.values()):
            self._end_with_error(stream, message, kind=kind)
        self.cancel_all()

    def cancel_all(self) -> None:
        """Cancel every stream's task, which aborts its engine request."""
        for stream in self._live:
            stream.task.cancel()

    async def wait(self) -> None:
        """Until every stream task has finished."""
        tasks = [stream.task for stream in self._live]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _forget(self, stream: Stream, admitted: Admitted) -> None:
        # A task cancelled before it ever ran (the client left at once) never enters _guard's
        # finally: end its admission here, or drain and the active gauge wait for it forever.
        admitted.end("cancelled")
        self._release(stream)
        self._live.discard(stream)
        self._ended()

    def _release(self, stream: Stream) -> None:
        """Free the stream's id, unless a new stream has taken it already."""
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]

    async def _guard(self, stream: Stream, admitted: Admitted, work: Callable[[], Awaitable[None]]) -> None:
        REQUEST_ID.set(stream.request_id)  # this task's context: every line it logs names the request
        log.debug("stream started", extra={"stream_id": stream.id, "kind": admitted.kind})
        reason = "cancelled"
        try:
            await work()
            reason = stream.finish or "cancelled"
        except SalienceError as exc:
            reason = "error"
            self._end_with_error(stream, str(exc), kind=type(exc).__name__, field=wire_field(exc.field))
        except asyncio.CancelledError:
            raise
        except Exception:
            reason = "error"
            log.exception("stream failed", extra={"stream_id": stream.id})
            self._end_with_error(stream, "internal server error", kind="InternalError")
        finally:
            admitted.end(reason)
            log.debug("stream ended", extra={"stream_id": stream.id, "finish_reason": reason})

    def _token(self, stream: Stream, payload: dict) -> None:
        terminal = payload.get("finish_reason") is not None
        if terminal:  # the stream's terminal payload: its id is free
            stream.finish = payload["finish_reason"]
            payload["request_id"] = stream.request_id
            self._release(stream)
        if "readout" in payload and not self._closed.is_set():
            self._readout_positions.inc()
            self._readout_bytes.inc(len(orjson.dumps(payload["readout"])))
        self._put("TOKEN", payload)
        if terminal and stream.finish != "cancelled":
            self._answer_late_cancel(stream)

    def _end_with_error(self, stream: Stream, message: str, *, kind: str, field: str | None = None) -> None:
        self._release(stream)
        self._error(stream.id, message, kind=kind, request_id=stream.request_id, field=field)
        self._answer_late_cancel(stream)

    def _answer_late_cancel(self, stream: Stream) -> None:
        """A CANCEL that reached a stream whose end was already made (its last token came out
        of the engine before the abort) is answered as one after the end: every CANCEL either
        ends its stream "cancelled" or gets "not running"."""
        if stream.cancelled:
            self._error(stream.id, f"CANCEL: stream {stream.id} is not running", request_id=stream.request_id)
