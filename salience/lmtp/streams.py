"""What each kind of stream sends: a GENERATE, a SCORE or a SESSION_GENERATE, run in the core
and told as LMTP payloads through `emit` (the connection's, which frees the stream's id when
the terminal payload goes out)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from salience.auth import Client
from salience.core.engine.detokenizer import TextStream
from salience.core.engine.engine import Engine
from salience.core.engine.generation import Generation
from salience.core.engine.prompts import Prompt
from salience.core.serving.sessions import SessionStore
from salience.core.serving.turns import TurnRun
from salience.errors import InvalidArgument
from salience.lmtp import payloads
from salience.lmtp.messages import Generate, Score, SessionGenerate
from salience.lmtp.terms import probes_of

__all__ = ["Emit", "Stream", "generate", "score", "session_generate"]

Emit = Callable[[dict], None]


@dataclass(eq=False)
class Stream:
    """One stream's state for its life. A new stream may reuse its id once its terminal payload
    is out, while this one's task winds down: so nothing of it lives in maps keyed by id."""

    id: int
    request_id: str
    client: Client  # whose it is: fair share and the client's limits count it
    task: asyncio.Task | None = None
    work: Generation | TurnRun | None = None  # what a CANCEL stops, once attached
    cancelled: bool = False  # a CANCEL named it (see attach)
    finish: str | None = None  # the finish reason its terminal payload carried

    async def attach(self, work: Generation | TurnRun) -> None:
        """Let CANCEL reach `work`. A CANCEL that came before the work existed (in the same frame
        as its request, or while a session turn was set up) cancels it now, before it reaches
        the engine: iterating it then ends at once with finish_reason CANCELLED."""
        self.work = work
        if self.cancelled:
            await work.cancel()


def emit_all(emit: Emit, many: Iterable[dict]) -> None:
    for payload in many:
        emit(payload)


async def prompt_of(engine: Engine, request: Generate | Score) -> Prompt:
    """The request's prompt: its token ids, or its messages rendered by the model's chat template
    (with their images)."""
    return Prompt(request.prompt) if request.messages is None else await engine.chat.prompt(request.messages)


async def generate(stream: Stream, engine: Engine, request: Generate, emit: Emit) -> None:
    """Tokens as the engine makes them, the prompt's readouts with the first."""
    stream_id = request.stream_id
    read = await prompt_of(engine, request)
    prompt = read.tokens
    await engine.check_constraint(request.structured_outputs)
    generation = engine.generate(
        prompt,
        payloads.sampling_options(request),
        **stream.client.engine_keywords(),
        probes=probes_of(request),
        images=read.images,
        request_id=stream.request_id,
    )
    if request.messages is not None:
        emit(payloads.prompt_ids_payload(stream_id, prompt))
    await stream.attach(generation)
    text = TextStream(engine.tokenizer, prompt) if request.text else None
    ended = False
    async with generation:
        async for event in generation:
            if event.position == len(prompt):  # first event: prompt readouts are in
                read = payloads.prompt_payloads(
                    stream_id, prompt, generation.prompt_readouts, generation.prompt_rows, request.readout_encoding
                )
                emit_all(emit, read)
            ended = event.finish_reason is not None
            finish = payloads.finish_reason(event.finish_reason, event.stopped_by)
            token = payloads.token_payload(
                stream_id,
                event,
                finish,
                top=True,
                text=text,
                readout=bool(request.readout),
                encoding=request.readout_encoding,
            )
            emit(token)
    if not ended:  # cancelled after its last token went out: end the stream explicitly
        reason = generation.finish_reason.value if generation.finish_reason else "cancelled"
        emit({"stream_id": stream_id, "finish_reason": reason})


async def score(stream: Stream, engine: Engine, request: Score, emit: Emit) -> None:
    """The prompt's readouts and the continuation's scores, from one prefill pass."""
    read = await prompt_of(engine, request)
    if read.images:
        raise InvalidArgument("messages hold an image, and SCORE reads none: GENERATE reads images in messages")
    # A SCORE is one short pass, not aborted once running: cancelled before it, it is never
    # submitted; cancelled during it, its results are dropped. Either way it ends "cancelled".
    cancelled = {"stream_id": request.stream_id, "finish_reason": "cancelled"}
    if stream.cancelled:
        emit(cancelled)
        return
    # One pass: the prompt's readouts and the continuation's scores.
    scores = await engine.score_pass(
        read.tokens,
        request.scored,
        **stream.client.engine_keywords(),
        top_logprobs=request.top_logprobs,
        probes=probes_of(request),
        request_id=stream.request_id,
    )
    if stream.cancelled:
        emit(cancelled)
        return
    prompt = read.tokens
    if request.messages is not None:
        emit(payloads.prompt_ids_payload(request.stream_id, prompt))
    scored = []
    if scores is not None:
        readouts = {p: r for p, r in scores.readouts.items() if p < len(prompt)}
        rows = {field: {p: r for p, r in taken.items() if p < len(prompt)} for field, taken in scores.rows.items()}
        emit_all(
            emit, payloads.prompt_payloads(request.stream_id, tuple(prompt), readouts, rows, request.readout_encoding)
        )
        scored = [scores.at(p) for p in range(len(prompt), len(scores.tokens))]
    text = TextStream(engine.tokenizer, prompt) if request.text else None
    scored_payloads = [
        payloads.token_payload(
            request.stream_id,
            token,
            "length" if i == len(scored) - 1 else None,
            top=request.top_logprobs > 0,
            text=text,
            readout=bool(request.readout),
            encoding=request.readout_encoding,
        )
        for i, token in enumerate(scored)
    ]
    if not scored_payloads:
        scored_payloads.append({"stream_id": request.stream_id, "finish_reason": "length"})
    emit_all(emit, scored_payloads)


async def session_generate(
    stream: Stream, engine: Engine, request: SessionGenerate, emit: Emit, sessions: SessionStore
) -> None:
    """A session turn: its prefill positions, its tokens, then the turn's end."""
    turn = payloads.turn(request, stream.request_id, stream.client)
    run = await sessions.start(request.session_id, turn, engine)
    stream_id = request.stream_id
    await stream.attach(run)
    text = None
    async with contextlib.aclosing(aiter(run)) as tokens:
        async for token in tokens:
            if request.text and text is None and not token.is_prefill:
                text = TextStream(engine.tokenizer, sessions.tokens(request.session_id, turn.client)[: token.position])
            emit(payloads.session_payload(stream_id, token, text, request.readout_encoding))
    assert run.done is not None
    emit(payloads.turn_end_payload(stream_id, run.done, text))
