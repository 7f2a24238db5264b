"""One LMTP connection: its running streams and replies (running.py, replies.py, outbox.py).

Theory of operation. A transport adapter (WebSocket or TCP) feeds each
received line to `receive` and runs `pump` to send frames. Every GENERATE or
SCORE becomes a task that puts payloads on one outbound queue; `pump` takes
whatever is queued at the moment it wakes and sends it as one frame per run
of the same type, so tokens of different streams that are ready together
share a frame and each stream's order is kept.

The queue is bounded: a client that stops reading while its streams produce
gets, once `max_pending` payloads wait, every stream ended with an error and
the connection closed (`closed` is set; the adapter closes its transport).
Closing the session (client gone, server stopping) cancels every stream,
which aborts its engine request at once.

The connection's client is read from its `Identity` at each message, so a reload of the tokens
file (SIGHUP) reaches it: a narrowed client needs its new scopes from its next message on; a
removed one's messages are refused as a wrong token is, its running streams finish, and once the
last has ended (at once if none runs) the connection closes with `revoked` set. Its CANCELs still
go through: they only end work it started.

Each stream has a request id: the message's `request_id`, else `<prefix>-<stream_id>`
when the connection brought an `x-request-id` prefix, else a new uuid4 hex. It is set
as the stream task's logging context, given to the engine, and put on the stream's
terminal payload and on every error payload.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine

from salience import metrics, request_ids
from salience.auth import Client, Identity
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import Phase, ServerStatus
from salience.errors import PermissionDenied, SalienceError
from salience.lmtp import replies
from salience.lmtp.codec import LmtpError, parse_client_line
from salience.lmtp.config import ConnectionLimits, LmtpConfig
from salience.lmtp.messages import (
    Cancel,
    ClientMessage,
    CloseSession,
    DefineConcept,
    DeleteConcept,
    Detokenize,
    DumpSession,
    ForkSession,
    Generate,
    ImageInfo,
    ModelInfo,
    OpenSession,
    PatchSweep,
    SaveConcepts,
    Score,
    SessionGenerate,
    Status,
    Tokenize,
)
from salience.lmtp.outbox import Outbox
from salience.lmtp.running import RunningStreams
from salience.lmtp.terms import scopes_of, wire_field
from salience.logs import CLIENT_NAME, REQUEST_ID

__all__ = ["UNAUTHORIZED", "ConnectionLimits", "LmtpConfig", "LmtpSession"]

log = logging.getLogger(__name__)

# What a missing or wrong token gets: the close message of a connection refused at its start, and the
# error of a message whose token names no client any more (counted as an auth failure, not an error).
UNAUTHORIZED = "unauthorized: missing or wrong token"
_UNAUTHORIZED_KIND = "Unauthorized"

# Why a connection was dropped (salience_connections_dropped_total's `cause`).
CLIENT_GONE, SLOW_CLIENT, SEND_TIMEOUT = "client_gone", "slow_client", "send_timeout"
OVERSIZED_FRAME, SERVER_SHUTDOWN = "oversized_frame", "server_shutdown"


class LmtpSession:
    def __init__(
        self,
        status: ServerStatus,
        config: LmtpConfig,
        sessions: SessionStore,
        *,
        frontend: str = "lmtp_ws",
        request_id_prefix: str | None = None,
        identity: Identity | None = None,
    ) -> None:
        """`identity`: what the connection offered (default: nothing, as on a transport that carries
        no token: an open server's anonymous client)."""
        self._status = status
        self._sessions = sessions
        self._limits = config.limits
        self._frontend = frontend
        self._identity = identity or Identity(config.tokens)
        self._name: str | None = None  # the client's, as last identified
        self._client()
        self.revoked = False  # closed because its token names no client any more
        self._request_id_prefix = request_id_prefix  # the connection's x-request-id header
        self._drop_cause: str | None = None
        self._ended = False
        metrics.CONNECTIONS_ACTIVE.labels(frontend).inc()
        self._tasks: set[asyncio.Task] = set()
        self._sweeps: dict[int, asyncio.Task] = {}  # running PATCH_SWEEPs by stream id, for CANCEL
        self._watcher: asyncio.Task | None = None
        self._outbox = Outbox(config.limits.max_pending, config.limits.send_timeout)
        self.closed = asyncio.Event()
        self._running = RunningStreams(
            status,
            sessions,
            frontend,
            put=self._put,
            error=self._error,
            spawn=self._spawn,
            closed=self.closed,
            ended=self._close_if_revoked,  # the last stream of a client the tokens no longer name
        )
        config.tokens.watch(self)

    # ---- input -------------------------------------------------------------------

    def receive(self, line: str | bytes) -> None:
        """Act on one client line; never raises for anything the client sent."""
        if self.closed.is_set():
            return
        client = self._client()
        try:
            message = parse_client_line(line, self._limits.max_message_bytes)
        except LmtpError as exc:
            self._reject(exc.kind, exc.stream_id, exc.message, exc.request_id, exc.field)
            return
        if isinstance(message, Cancel):  # needs no scope, and only ends what the connection started
            sweep = self._sweeps.pop(message.stream_id, None)
            if sweep is not None:
                sweep.cancel()
            else:
                self._running.cancel(message.stream_id)
        elif client is None:
            self._refuse(message, UNAUTHORIZED, _UNAUTHORIZED_KIND)
        else:
            self._dispatch(message, client)

    def _client(self) -> Client | None:
        """The connection's client as the tokens are now (a reload may have changed it)."""
        client = self._identity.client
        if client is not None:
            self._name = client.name
            CLIENT_NAME.set(client.name)  # the connection's task, and the streams it starts, log it
        return client

    def reject(self, message: str) -> None:
        """Report a transport-level problem (e.g. an oversized line) to the client."""
        self._msg(self._failed(None, message, "LmtpError"))

    def dropping(self, cause: str) -> None:
        """The transport is about to close the connection, for `cause` (e.g. OVERSIZED_FRAME)."""
        self._drop_cause = self._drop_cause or cause

    def _dispatch(self, message: ClientMessage, client: Client) -> None:
        try:
            client.require(scopes_of(message))
        except PermissionDenied as exc:
            self._refuse(message, str(exc), "PermissionDenied")
            return
        match message:
            case Generate() | Score() | SessionGenerate():
                request_id = message.request_id or self._new_request_id(message.stream_id)
                self._running.start(message, request_id, client)
            case ModelInfo(stream_id=stream_id):
                self._msg({"stream_id": stream_id, "model_info": replies.model_info(self._status)})
            case Status(stream_id=stream_id):
                self._status_reply(stream_id)
                if self._watcher is None:
                    self._watcher = asyncio.create_task(self._watch_status(stream_id))
            case Tokenize() | Detokenize():
                self._spawn(self._answer(message.stream_id, replies.tokenizer(self._status, message)))
            case ImageInfo():
                self._spawn(self._answer(message.stream_id, replies.image_info(self._status, message)))
            case DefineConcept() | DeleteConcept() | SaveConcepts():
                call = replies.concepts_call(self._status, message, frontend=self._frontend)
                self._spawn(self._answer(message.stream_id, call))
            case PatchSweep(stream_id=stream_id):
                self._sweep(message, client)
            case OpenSession() | CloseSession() | ForkSession() | DumpSession():
                self._spawn(
                    self._answer(message.stream_id, replies.session_call(self._status, self._sessions, message, client))
                )

    def _sweep(self, message: PatchSweep, client: Client) -> None:
        """Run a sweep, telling its progress as cells finish (at most every 2%), then its grid;
        cancelled, it answers with an error saying so."""
        stream_id = message.stream_id
        if stream_id in self._sweeps:
            self._msg(self._failed(stream_id, f"stream_id {stream_id} already runs a sweep", "InvalidArgument"))
            return
        told = [0]

        def progress(done: int, total: int) -> None:
            if done == total or done - told[0] >= max(1, total // 50):
                told[0] = done
                self._msg({"stream_id": stream_id, "progress": {"done": done, "total": total}})

        async def run() -> None:
            try:
                await self._answer(
                    stream_id, replies.sweep_call(self._status, message, client, progress, frontend=self._frontend)
                )
            except asyncio.CancelledError:
                self._msg(self._failed(stream_id, "the sweep was cancelled", "Cancelled"))
            finally:
                self._sweeps.pop(stream_id, None)

        self._sweeps[stream_id] = self._spawn(run())

    def _refuse(self, message: ClientMessage, error: str, kind: str) -> None:
        if isinstance(message, Generate | Score | SessionGenerate):
            self._error(message.stream_id, error, kind=kind, request_id=message.request_id)
        else:
            self._msg(self._failed(getattr(message, "stream_id", None), error, kind))

    def tokens_reloaded(self) -> None:
        """The tokens file was reloaded: a connection whose token names no client any more closes
        now if no stream of it runs (else once the last ends)."""
        self._close_if_revoked()

    def _close_if_revoked(self) -> None:
        if self._running.idle and not self.closed.is_set() and self._identity.client is None:
            log.info("closing: the connection's token names no client any more", extra={"client": self._name})
            self.revoked = True
            self.close()

    def _reject(
        self,
        kind: str | None,
        stream_id: int | None,
        message: str,
        request_id: str | None = None,
        field: str | None = None,
    ) -> None:
        # Stream errors go where LMQL's client looks for them, or it waits forever.
        if kind in ("GENERATE", "SCORE", "SESSION_GENERATE") and stream_id is not None:
            self._error(stream_id, message, request_id=request_id, field=field)
        else:
            self._msg(self._failed(stream_id, message, "LmtpError", request_id, field=field))

    # ---- replies ---------------------------------------------------------------------

    def _status_reply(self, stream_id: int) -> None:
        self._msg({"stream_id": stream_id, "status": self._status.phase.value, "model": self._status.model_name})

    async def _answer(self, stream_id: int, reply: Awaitable[dict]) -> None:
        """Send `reply`'s fields, or the error it raised."""
        try:
            payload = {"stream_id": stream_id, **await reply}
        except SalienceError as exc:
            kind, field = type(exc).__name__, wire_field(exc.field)
            payload = self._failed(stream_id, str(exc), kind, retry_after=exc.retry_after, field=field)
        self._msg(payload)

    async def _watch_status(self, stream_id: int) -> None:
        while True:
            await self._status.changed.wait()
            self._status_reply(stream_id)

    def _spawn(self, work: Coroutine[object, object, None], request_id: str | None = None) -> asyncio.Task:
        """Run a reply that must await, keeping the task referenced until it ends; what it
        logs names `request_id`."""
        context = contextvars.copy_context()
        if request_id is not None:
            context.run(REQUEST_ID.set, request_id)
        task = asyncio.get_running_loop().create_task(work, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- output ------------------------------------------------------------------------

    def _error(
        self,
        stream_id: int,
        message: str,
        *,
        kind: str = "LmtpError",
        request_id: str | None = None,
        retry_after: float | None = None,
        field: str | None = None,
    ) -> None:
        """End a stream with an error (`kind`: the SalienceError class, or what else went wrong)."""
        self._put("TOKEN", self._failed(stream_id, message, kind, request_id, retry_after, field), force=True)

    def _failed(
        self,
        stream_id: int | None,
        message: str,
        kind: str,
        request_id: str | None = None,
        retry_after: float | None = None,
        field: str | None = None,
    ) -> dict:
        """An error payload naming its request (the running stream's, if the id names one), the
        message's field at fault (`field`, beside `error`), and `retry_after` seconds past a
        client's limit; counted and logged."""
        running = self._running.get(stream_id)
        request_id = request_id or (running and running.request_id) or self._new_request_id(stream_id)
        if kind == _UNAUTHORIZED_KIND:  # counted apart, as a wrong token at the start is
            metrics.AUTH_FAILURES.labels(self._frontend).inc()
        else:
            metrics.ERRORS.labels(self._frontend, kind).inc()
        extra = {"request_id": request_id, "stream_id": stream_id, "kind": kind, "error": message}
        log.info("request failed", extra=extra)
        payload = {"stream_id": stream_id, "error": message}
        if field is not None:
            payload["field"] = field
        payload["request_id"] = request_id
        if retry_after is not None:
            payload["retry_after"] = retry_after
        return payload

    def _new_request_id(self, stream_id: int | None) -> str:
        if self._request_id_prefix is not None and stream_id is not None:
            return f"{self._request_id_prefix}-{stream_id}"
        return request_ids.new()

    def _msg(self, payload: dict) -> None:
        self._put("MSG", payload, force=True)

    def _put(self, kind: str, payload: dict, force: bool = False) -> None:
        if self.closed.is_set():
            return
        if self._outbox.full() and not force:
            self._overflow()
            return
        self._outbox.put(kind, payload)

    def _overflow(self) -> None:
        message = f"client is not reading: more than {self._limits.max_pending} messages are waiting; closing"
        log.warning("slow client", extra={"pending": len(self._outbox)})
        self.dropping(SLOW_CLIENT)
        self._running.end_all(message, "SlowClient")
        self._outbox.close()  # the errors still go out
        self.closed.set()

    async def pump(self, send: Callable[[str], Awaitable[None]]) -> None:
        """Send queued payloads until the session closes; a send slower than the limit closes it."""
        try:
            if not await self._outbox.pump(send):
                log.warning("send timed out; closing", extra={"timeout": self._limits.send_timeout})
                self.dropping(SEND_TIMEOUT)
        finally:
            self.close()

    def close(self) -> None:
        """Cancel every stream (aborting its engine request) and stop accepting input."""
        if not self._ended:
            self._ended = True
            metrics.CONNECTIONS_ACTIVE.labels(self._frontend).dec()
            cause = self._drop_cause
            if cause is None and self._status.phase is Phase.STOPPING:
                cause = SERVER_SHUTDOWN
            elif cause is None and self._running:
                cause = CLIENT_GONE
            if cause is not None:
                metrics.CONNECTIONS_DROPPED.labels(self._frontend, cause).inc()
                log.info("connection dropped", extra={"cause": cause, "streams": len(self._running)})
        self._running.cancel_all()
        for sweep in self._sweeps.values():
            sweep.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        self._outbox.close()
        self.closed.set()

    async def flush(self, timeout: float) -> None:
        """Until what is queued has been sent, for up to `timeout` seconds: the server's
        shutdown waits for it (a drain's last payloads) before it closes the transport."""
        await self._outbox.flush(timeout)

    async def wait_closed(self) -> None:
        """Until every stream task has finished (their engine requests are aborted)."""
        await self._running.wait()
