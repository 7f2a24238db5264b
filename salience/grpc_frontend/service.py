"""The salience.v1.Salience servicer: protobuf in, core calls, protobuf out. No logic of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator

import grpc

from salience import metrics
from salience.core.engine.requests import (
    NO_PROBES,
    Constraint,
    FinishReason,
    ImageBlock,
    Probes,
    SamplingOptions,
)
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import Admitted, ServerStatus
from salience.core.serving.turns import SessionToken, Turn, TurnDone, TurnRun
from salience.errors import under
from salience.grpc_frontend.auth import CLIENT
from salience.grpc_frontend.status_codes import translating, translating_stream
from salience.logs import REQUEST_ID
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from salience.scopes import asked

__all__ = ["SEED_FIELDS", "SalienceService", "counted", "run_turn", "seed_event", "turn_from"]

_FINISH = {
    FinishReason.STOP: pb.GenerateDone.FINISH_REASON_EOS,
    FinishReason.LENGTH: pb.GenerateDone.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.GenerateDone.FINISH_REASON_CANCELLED,
    # The seed has no value for a monitor's stop: ExtendedGenerateEvent.stopped_by names it.
    FinishReason.MONITOR: pb.GenerateDone.FINISH_REASON_UNSPECIFIED,
}


# Core's names for a GenerateRequest's fields that the seed proto spells otherwise (an error's field).
SEED_FIELDS = {"logprobs": "logprob_top_k"}


class SalienceService(salience_pb2_grpc.SalienceServicer):
    def __init__(self, status: ServerStatus, sessions: SessionStore) -> None:
        self._status = status
        self._sessions = sessions

    @translating
    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext):
        engine = self._status.serving_engine()
        self._status.check_model(request.model or None)  # proto3: unset is "", the served model
        session_id = self._sessions.open(*_owner())
        return pb.OpenSessionResponse(session_id=session_id, max_model_len=engine.max_model_len)

    @translating
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext):
        await self._sessions.close(request.session_id, CLIENT.get().share)
        return pb.CloseSessionResponse()

    @translating
    async def ForkSession(self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext):
        return pb.ForkSessionResponse(
            session_id=self._sessions.fork(request.session_id, request.at_position, *_owner())
        )

    @translating
    async def DumpSession(self, request: pb.DumpSessionRequest, context: grpc.aio.ServicerContext):
        return pb.DumpSessionResponse(tokens=self._sessions.tokens(request.session_id, CLIENT.get().share))

    @translating
    async def GetReadoutManifest(self, request: pb.GetReadoutManifestRequest, context: grpc.aio.ServicerContext):
        engine = self._status.serving_engine()
        m = engine.readout_manifest
        if m is None:  # no concept set: nothing to read out
            return pb.ReadoutManifest(hidden_size=engine.hidden_size, dtype="float32")
        return pb.ReadoutManifest(concepts=m.concepts, layers=m.layers, hidden_size=m.hidden_size, dtype=m.dtype)

    @translating_stream
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        with under(names=SEED_FIELDS):
            turn = turn_from(request, REQUEST_ID.get())
            async with contextlib.aclosing(run_turn(self._status, self._sessions, request.session_id, turn)) as items:
                async for item in items:
                    yield seed_event(item)


async def run_turn(
    status: ServerStatus, sessions: SessionStore, session_id: str, turn: Turn
) -> AsyncIterator[SessionToken | TurnDone]:
    """A session turn, counted: its tokens, then how it ended."""
    with admit_turn(status, turn) as admitted:
        run = await sessions.start(session_id, turn, admitted.engine)
        async with contextlib.aclosing(counted(admitted, run)) as items:
            async for item in items:
                yield item


def _owner() -> tuple[str, int | None]:
    """The call's client as a session's owner (it reaches only its own), and how many it may hold."""
    client = CLIENT.get()
    return client.share, client.limits.sessions


def admit_turn(status: ServerStatus, turn: Turn) -> Admitted:
    """A session turn's admission: the scopes what it asks for needs (the method's own were
    checked by the interceptor), then its client's stream limit."""
    client = CLIENT.get()
    client.require(asked(turn.probes))
    return status.admit("grpc", "session_generate", **client.admission())


async def counted(admitted: Admitted, run: TurnRun) -> AsyncIterator[SessionToken | TurnDone]:
    """A started turn's tokens, then how it ended, counted in the metrics."""
    async with contextlib.aclosing(aiter(run)) as tokens:
        async for token in tokens:
            if token.readout is not None:
                metrics.READOUT_POSITIONS.labels("grpc").inc()
                metrics.READOUT_BYTES.labels("grpc").inc(4 * len(token.readout))
            yield token
    assert run.done is not None
    admitted.end(run.done.finish_reason.value)
    yield run.done


def seed_event(item: SessionToken | TurnDone) -> pb.GenerateEvent:
    """A turn's token or end as the seed's GenerateEvent (a probability with no calibration: NaN)."""
    if isinstance(item, TurnDone):
        return pb.GenerateEvent(done=_done(item))
    return pb.GenerateEvent(token=_token(item))


def turn_from(
    request: pb.GenerateRequest,
    request_id: str | None = None,
    probes: Probes = NO_PROBES,
    constraint: Constraint | None = None,
) -> Turn:
    """The core Turn a seed GenerateRequest asks for (and, from the extensions, what else it reads
    and steers, and its constraint), as the call's client's. The seed's readout ranges join the
    extensions' probes."""
    return Turn(
        **CLIENT.get().engine_keywords(),
        probes=dataclasses.replace(probes, readout_ranges=tuple((r.start, r.end) for r in request.readout_ranges)),
        request_id=request_id,
        offset=request.offset,
        truncating=request.truncating,
        append=tuple(request.append_tokens),
        images=tuple(
            ImageBlock(start=i.pad_range_start, end=i.pad_range_end, data=i.bytes, mime=i.mime) for i in request.images
        ),
        logprob_ranges=[(r.start, r.end) for r in request.logprobs_ranges],
        logprob_top_k=request.logprob_top_k,
        sampling=SamplingOptions(
            max_tokens=request.max_tokens,
            temperature=request.temperature or 1.0,  # the seed: zero means the default, 1.0
            top_p=request.top_p or 1.0,
            top_k=request.top_k,
            stop_token_ids=tuple(request.stop_token_ids),
            priority=request.priority,
            structured_outputs=constraint,
        ),
    )


def _token(token: SessionToken) -> pb.Token:
    message = pb.Token(id=token.token_id, position=token.position, is_prefill=token.is_prefill)
    if token.readout is not None:
        message.readout.extend(math.nan if value is None else value for value in token.readout)
    if token.logprob is not None:
        message.sampled_logprob = token.logprob
        message.has_sampled_logprob = True
    message.logprobs.extend(pb.TokenLogprob(id=t, logprob=lp) for t, lp in token.top_logprobs)
    return message


def _done(done: TurnDone) -> pb.GenerateDone:
    return pb.GenerateDone(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        total_tokens=done.total_tokens,
        finish_reason=_FINISH[done.finish_reason],
    )
