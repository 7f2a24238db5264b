"""The MSG replies that are not streams: model info, tokenizer, image info and session calls.

Each returns the reply's fields (the connection adds `stream_id`) or raises a SalienceError,
which the connection turns into the error payload every frontend error takes.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from collections.abc import Callable

from salience.auth import Client
from salience.core.engine.images import Vision
from salience.core.serving import live_concepts
from salience.core.serving.patch_sweep import Sweep, sweep
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import Phase, ServerStatus
from salience.lmtp.messages import (
    CloseSession,
    DefineConcept,
    DeleteConcept,
    Detokenize,
    DumpSession,
    ForkSession,
    ImageInfo,
    OpenSession,
    PatchSweep,
    SaveConcepts,
    Tokenize,
)

__all__ = ["concepts_call", "image_info", "model_info", "session_call", "sweep_call", "tokenizer"]


def model_info(status: ServerStatus) -> dict | str:
    engine = status.engine
    if engine is None or status.phase is not Phase.READY:
        return "<unavailable>"  # LMQL's client retries on this
    return {
        "model": status.model_name,
        "model_type": "salience",
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "max_logprobs": engine.max_logprobs,
        "eos_token_id": engine.tokenizer.eos_token_id,
        "chat_template": engine.chat.has_template,  # whether GENERATE/SCORE take `messages` (the REPL chats)
        "readout_manifest": dataclasses.asdict(manifest) if (manifest := engine.readout_manifest) else None,
        "steering": engine.steering_manifest(),
        "saes": [sae.info for sae in engine.saes],
    }


async def tokenizer(status: ServerStatus, request: Tokenize | Detokenize) -> dict:
    engine = status.serving_engine()
    if isinstance(request, Tokenize):
        return {"tokens": list(engine.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens))}
    return {"text": engine.tokenizer.decode(engine.check_tokens("tokens", request.tokens))}


async def image_info(status: ServerStatus, request: ImageInfo) -> dict:
    engine = status.serving_engine()
    vision = Vision.of(engine.vision, engine.model_name)
    facts = await asyncio.to_thread(vision.inspect, request.data, request.mime)  # decoding takes a while
    width, height = facts.size
    return {
        "pad_tokens": facts.pads,
        "block_tokens": facts.pads + 2,
        "grid_thw": list(facts.grid),
        "vision_start_token_id": vision.start,
        "image_pad_token_id": vision.pad,
        "vision_end_token_id": vision.end,
        "width": width,
        "height": height,
    }


async def session_call(
    status: ServerStatus,
    sessions: SessionStore,
    request: OpenSession | CloseSession | ForkSession | DumpSession,
    client: Client,
) -> dict:
    """A session act of `client`, on its own sessions only; a new one (open, fork) is its, held to its limit."""
    owner = client.share
    match request:
        case OpenSession(model=model):
            engine = status.serving_engine()
            status.check_model(model)
            return {"session_id": sessions.open(owner, client.limits.sessions), "max_model_len": engine.max_model_len}
        case CloseSession(session_id=session_id):
            await sessions.close(session_id, owner)
            return {"session_id": session_id, "closed": True}
        case ForkSession(session_id=session_id, at_position=at):
            return {"session_id": sessions.fork(session_id, at, owner, client.limits.sessions), "length": at}
        case DumpSession(session_id=session_id):
            return {"session_id": session_id, "tokens": sessions.tokens(session_id, owner)}


async def sweep_call(
    status: ServerStatus, request: PatchSweep, client: Client, progress: Callable[[int, int], None], *, frontend: str
) -> dict:
    """Run a PATCH_SWEEP as one of the client's streams; the reply carries the grid."""
    asked = Sweep(
        clean=request.clean,
        corrupted=request.corrupted,
        answer=request.answer,
        foil=request.foil,
        points=request.points,
        layers=request.layers,
        positions=request.positions,
        metric=request.metric,
    )
    with status.admit(frontend, "patch_sweep", **client.admission()) as admitted:
        grid = await sweep(admitted.engine, asked, progress=progress, client=client.share, weight=client.weight)
    return {"sweep": grid.to_json()}


async def concepts_call(
    status: ServerStatus, request: DefineConcept | DeleteConcept | SaveConcepts, *, frontend: str
) -> dict:
    match request:
        case DefineConcept():
            definition = live_concepts.ConceptDefinition(
                name=request.name,
                positive=request.positive,
                negative=request.negative,
                method=request.method,
                layers=request.layers,
                vector=request.vector,
                vectors=request.vectors,
            )
            return await live_concepts.define(status, definition, frontend=frontend)
        case DeleteConcept(name=name):
            return await live_concepts.delete(status, name)
        case SaveConcepts():
            data = live_concepts.save(status)
            return {"concept_set": base64.b64encode(data).decode("ascii"), "bytes": len(data)}
