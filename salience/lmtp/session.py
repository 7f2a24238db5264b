"""One LMTP connection: running streams, replies, and the outbound queue.

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from salience.core.engine import Engine, Generation
from salience.core.images import Vision
from salience.core.sessions import SessionStore, SessionToken, Turn, TurnRun
from salience.core.status import Phase, ServerStatus
from salience.core.text import TextStream
from salience.core.types import SamplingOptions, ScoredToken, TokenEvent
from salience.errors import SalienceError
from salience.lmtp.codec import LmtpError, msg_frame, parse_client_line, token_frame
from salience.lmtp.messages import (
    Cancel,
    ClientMessage,
    CloseSession,
    Detokenize,
    DumpSession,
    ForkSession,
    Generate,
    ImageInfo,
    ModelInfo,
    OpenSession,
    Score,
    SessionGenerate,
    Status,
    Tokenize,
)

__all__ = ["ConnectionLimits", "LmtpConfig", "LmtpSession"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    max_pending: int = 65536  # payloads waiting for a client that does not read
    send_timeout: float = 30.0  # seconds one frame may take to go out


@dataclass(frozen=True, kw_only=True)
class LmtpConfig:
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    auth_token: str | None = None  # required of every WebSocket client when set


class LmtpSession:
    def __init__(self, status: ServerStatus, config: LmtpConfig, sessions: SessionStore) -> None:
        self._status = status
        self._sessions = sessions
        self._limits = config.limits
        self._tasks: set[asyncio.Task] = set()
        self._watcher: asyncio.Task | None = None
        self._queue: deque[tuple[str, dict]] = deque()
        self._wake = asyncio.Event()
        self._streams: dict[int, asyncio.Task] = {}
        self._generations: dict[int, Generation | TurnRun] = {}
        self.closed = asyncio.Event()

    # ---- input -------------------------------------------------------------------

    def receive(self, line: str | bytes) -> None:
        """Act on one client line; never raises for anything the client sent."""
        if self.closed.is_set():
            return
        try:
            message = parse_client_line(line)
        except LmtpError as exc:
            self._reject(exc.kind, exc.stream_id, exc.message)
            return
        self._dispatch(message)

    def reject(self, message: str) -> None:
        """Report a transport-level problem (e.g. an oversized line) to the client."""
        self._msg({"stream_id": None, "error": message})

    def _dispatch(self, message: ClientMessage) -> None:
        match message:
            case Generate() | Score() | SessionGenerate():
                self._start(message)
            case Cancel(stream_id=stream_id):
                generation = self._generations.get(stream_id)
                if generation is not None:
                    self._spawn(generation.cancel())
                elif stream_id not in self._streams:
                    self._error(stream_id, f"CANCEL: stream {stream_id} is not running")
            case ModelInfo(stream_id=stream_id):
                self._msg({"stream_id": stream_id, "model_info": self._model_info()})
            case Status(stream_id=stream_id):
                self._status_reply(stream_id)
                if self._watcher is None:
                    self._watcher = asyncio.create_task(self._watch_status(stream_id))
            case Tokenize() | Detokenize():
                self._tokenizer_reply(message)
            case ImageInfo():
                self._spawn(self._image_info_reply(message))
            case OpenSession() | CloseSession() | ForkSession() | DumpSession():
                self._spawn(self._session_reply(message))

    def _reject(self, kind: str | None, stream_id: int | None, message: str) -> None:
        # Stream errors go where LMQL's client looks for them, or it waits forever.
        if kind in ("GENERATE", "SCORE", "SESSION_GENERATE") and stream_id is not None:
            self._error(stream_id, message)
        else:
            self._msg({"stream_id": stream_id, "error": message})

    # ---- streams -------------------------------------------------------------------

    def _start(self, request: Generate | Score | SessionGenerate) -> None:
        stream_id = request.stream_id
        if stream_id in self._streams:
            self._error(stream_id, f"stream_id {stream_id} is already running on this connection")
            return
        try:
            engine = self._status.serving_engine()
            self._status.check_model(getattr(request, "model", None))
        except SalienceError as exc:
            self._error(stream_id, str(exc))
            return
        handlers = {Generate: self._generate, Score: self._score, SessionGenerate: self._session_generate}
        run = handlers[type(request)]
        task = asyncio.create_task(self._guard(stream_id, run(engine, request)))
        self._streams[stream_id] = task
        task.add_done_callback(lambda _: self._streams.pop(stream_id, None))

    async def _guard(self, stream_id: int, work: Awaitable[None]) -> None:
        try:
            await work
        except SalienceError as exc:
            self._error(stream_id, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("stream failed", extra={"stream_id": stream_id})
            self._error(stream_id, "internal server error")

    async def _generate(self, engine: Engine, request: Generate) -> None:
        generation = engine.generate(request.prompt, _options(request), readout_ranges=request.readout)
        stream_id = request.stream_id
        self._generations[stream_id] = generation
        text = TextStream(engine.tokenizer, request.prompt) if request.text else None
        ended = False
        try:
            async with generation:
                async for event in generation:
                    if event.position == len(request.prompt):  # first event: prompt readouts are in
                        self._prompt_readouts(stream_id, request.prompt, generation.prompt_readouts)
                    ended = event.finish_reason is not None
                    finish = event.finish_reason and event.finish_reason.value
                    self._token(_payload(stream_id, event, finish, top=True, text=text, readout=bool(request.readout)))
        finally:
            self._generations.pop(stream_id, None)
        if not ended:  # cancelled after its last token went out: end the stream explicitly
            reason = generation.finish_reason.value if generation.finish_reason else "cancelled"
            self._token({"stream_id": stream_id, "finish_reason": reason})

    async def _score(self, engine: Engine, request: Score) -> None:
        prompt, continuation = engine.check_scoring(request.prompt, request.scored)
        scored = []
        if continuation or request.readout:  # one pass: the prompt's readouts and the continuation's scores
            ids = prompt + continuation
            scores = await engine.prefill(ids, top_logprobs=request.top_logprobs, readout_ranges=request.readout)
            readouts = {p: r for p, r in scores.readouts.items() if p < len(prompt)}
            self._prompt_readouts(request.stream_id, request.prompt, readouts)
            scored = [scores.at(p) for p in range(len(prompt), len(ids))]
        text = TextStream(engine.tokenizer, request.prompt) if request.text else None
        payloads = [
            _payload(
                request.stream_id,
                token,
                "length" if i == len(scored) - 1 else None,
                top=request.top_logprobs > 0,
                text=text,
                readout=bool(request.readout),
            )
            for i, token in enumerate(scored)
        ]
        if not payloads:
            payloads.append({"stream_id": request.stream_id, "finish_reason": "length"})
        for payload in payloads:
            self._token(payload)

    async def _session_generate(self, engine: Engine, request: SessionGenerate) -> None:
        turn = Turn(
            offset=request.offset,
            truncating=request.truncating,
            append=request.append,
            images=request.images,
            logprob_ranges=request.logprobs,
            logprob_top_k=request.top_logprobs,
            readout_ranges=request.readout,
            sampling=SamplingOptions(
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=max(request.top_k, 0),
                seed=request.seed,
                stop_token_ids=request.stop_token_ids,
                priority=request.priority,
            ),
        )
        run = await self._sessions.start(request.session_id, turn)
        stream_id = request.stream_id
        self._generations[stream_id] = run
        text = None
        try:
            async with contextlib.aclosing(aiter(run)) as tokens:
                async for token in tokens:
                    if request.text and text is None and not token.is_prefill:
                        text = TextStream(engine.tokenizer, self._sessions.tokens(request.session_id)[: token.position])
                    self._token(_session_payload(stream_id, token, text))
        finally:
            self._generations.pop(stream_id, None)
        assert run.done is not None
        done = run.done
        final = {"stream_id": stream_id, "finish_reason": done.finish_reason.value}
        if text is not None:
            final["text"] = text.flush()
        final["usage"] = {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.total_tokens,
            "cached_tokens": done.cached_tokens,
        }
        self._token(final)

    async def _session_reply(self, request: OpenSession | CloseSession | ForkSession | DumpSession) -> None:
        reply: dict = {"stream_id": request.stream_id}
        try:
            match request:
                case OpenSession(model=model):
                    engine = self._status.serving_engine()
                    self._status.check_model(model)
                    reply |= {"session_id": self._sessions.open(), "max_model_len": engine.max_model_len}
                case CloseSession(session_id=session_id):
                    await self._sessions.close(session_id)
                    reply |= {"session_id": session_id, "closed": True}
                case ForkSession(session_id=session_id, at_position=at):
                    reply |= {"session_id": self._sessions.fork(session_id, at), "length": at}
                case DumpSession(session_id=session_id):
                    reply |= {"session_id": session_id, "tokens": self._sessions.tokens(session_id)}
        except SalienceError as exc:
            reply["error"] = str(exc)
        self._msg(reply)

    def _prompt_readouts(self, stream_id: int, prompt: tuple[int, ...], readouts: dict) -> None:
        """Prompt positions' readouts go first, as payloads marked "prompt": true."""
        for position in sorted(readouts):
            self._token(
                {
                    "stream_id": stream_id,
                    "token": prompt[position],
                    "position": position,
                    "prompt": True,
                    "finish_reason": None,
                    "readout": readouts[position],
                }
            )

    # ---- replies ---------------------------------------------------------------------

    def _status_reply(self, stream_id: int) -> None:
        self._msg({"stream_id": stream_id, "status": self._status.phase.value, "model": self._status.model_name})

    async def _watch_status(self, stream_id: int) -> None:
        while True:
            await self._status.changed.wait()
            self._status_reply(stream_id)

    def _model_info(self) -> dict | str:
        engine = self._status.engine
        if engine is None or self._status.phase is not Phase.READY:
            return "<unavailable>"  # LMQL's client retries on this
        return {
            "model": self._status.model_name,
            "model_type": "salience",
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "max_logprobs": engine.max_logprobs,
            "eos_token_id": engine.tokenizer.eos_token_id,
            "readout_manifest": dataclasses.asdict(engine.readouts.manifest) if engine.readouts else None,
        }

    def _tokenizer_reply(self, request: Tokenize | Detokenize) -> None:
        try:
            engine = self._status.serving_engine()
            if isinstance(request, Tokenize):
                tokens = engine.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
                reply = {"stream_id": request.stream_id, "tokens": list(tokens)}
            else:
                tokens = engine.check_tokens("tokens", request.tokens)
                reply = {"stream_id": request.stream_id, "text": engine.tokenizer.decode(tokens)}
        except SalienceError as exc:
            reply = {"stream_id": request.stream_id, "error": str(exc)}
        self._msg(reply)

    def _spawn(self, work: Awaitable[None]) -> None:
        """Run a reply that must await, keeping the task referenced until it ends."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _image_info_reply(self, request: ImageInfo) -> None:
        reply: dict = {"stream_id": request.stream_id}
        try:
            engine = self._status.serving_engine()
            vision = Vision.of(engine.vision, engine.model_name)
            facts = await asyncio.to_thread(vision.inspect, request.data, request.mime)
            width, height = facts.size
            reply |= {
                "pad_tokens": facts.pads,
                "block_tokens": facts.pads + 2,
                "grid_thw": list(facts.grid),
                "vision_start_token_id": vision.start,
                "image_pad_token_id": vision.pad,
                "vision_end_token_id": vision.end,
                "width": width,
                "height": height,
            }
        except SalienceError as exc:
            reply["error"] = str(exc)
        self._msg(reply)

    # ---- output ------------------------------------------------------------------------

    def _token(self, payload: dict) -> None:
        self._put("TOKEN", payload)

    def _error(self, stream_id: int, message: str) -> None:
        self._put("TOKEN", {"stream_id": stream_id, "error": message}, force=True)

    def _msg(self, payload: dict) -> None:
        self._put("MSG", payload, force=True)

    def _put(self, kind: str, payload: dict, force: bool = False) -> None:
        if self.closed.is_set():
            return
        if len(self._queue) >= self._limits.max_pending and not force:
            self._overflow()
            return
        self._queue.append((kind, payload))
        self._wake.set()

    def _overflow(self) -> None:
        message = f"client is not reading: more than {self._limits.max_pending} messages are waiting; closing"
        log.warning("slow client", extra={"pending": len(self._queue)})
        for stream_id, task in list(self._streams.items()):
            task.cancel()
            self._error(stream_id, message)
        self.closed.set()

    async def pump(self, send: Callable[[str], Awaitable[None]]) -> None:
        """Send queued payloads until the session closes; a send slower than the limit closes it."""
        try:
            while True:
                if not self._queue:
                    if self.closed.is_set():
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                kind, run = self._queue[0][0], []
                while self._queue and self._queue[0][0] == kind:
                    run.append(self._queue.popleft()[1])
                frame = token_frame(run) if kind == "TOKEN" else msg_frame(run)
                try:
                    await asyncio.wait_for(send(frame), self._limits.send_timeout)
                except TimeoutError:
                    log.warning("send timed out; closing", extra={"timeout": self._limits.send_timeout})
                    self.close()
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Cancel every stream (aborting its engine request) and stop accepting input."""
        for task in list(self._streams.values()):
            task.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        self.closed.set()
        self._wake.set()

    async def wait_closed(self) -> None:
        """Until every stream task has finished (their engine requests are aborted)."""
        tasks = list(self._streams.values())
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _payload(
    stream_id: int,
    token: TokenEvent | ScoredToken,
    finish_reason: str | None,
    *,
    top: bool,
    text: TextStream | None,
    readout: bool,
) -> dict:
    """One TOKEN payload: the fields LMQL reads, plus the extensions the request asked for."""
    payload = {
        "token": token.token_id,
        "stream_id": stream_id,
        "logprob": token.logprob,
        "finish_reason": finish_reason,
    }
    if top:  # truncated alternatives (-inf) cannot be sampled and have no JSON form
        payload["top_logprobs"] = {str(t): lp for t, lp in token.top_logprobs if math.isfinite(lp)}
    if text is not None:
        payload["text"] = text.push(token.token_id) + (text.flush() if finish_reason else "")
    if readout:
        payload["position"] = token.position
        if token.readout is not None:
            payload["readout"] = token.readout
    return payload


def _session_payload(stream_id: int, token: SessionToken, text: TextStream | None) -> dict:
    """A session turn's TOKEN payload: prompt positions marked "prompt": true; fields only where covered."""
    payload: dict = {"stream_id": stream_id, "token": token.token_id, "position": token.position}
    if token.is_prefill:
        payload["prompt"] = True
    if token.logprob is not None:
        payload["logprob"] = token.logprob
    if token.top_logprobs:
        payload["top_logprobs"] = {str(t): lp for t, lp in token.top_logprobs if math.isfinite(lp)}
    if token.readout is not None:
        payload["readout"] = token.readout
    if text is not None and not token.is_prefill:
        payload["text"] = text.push(token.token_id)
    payload["finish_reason"] = None
    return payload


def _options(request: Generate) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k, 0),  # LMQL and vLLM spell "off" as -1 too
        seed=request.seed,
        stop_token_ids=request.stop_token_ids,
        logit_bias=request.logit_bias,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        priority=request.priority,
        logprobs=request.top_logprobs,
        ignore_eos=request.ignore_eos,
    )
