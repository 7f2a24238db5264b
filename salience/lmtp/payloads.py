"""LMTP requests as core calls, and core results as LMTP payloads: the frontend's translation,
kept apart from the connection that sequences it (session.py)."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence

import numpy as np

from salience.auth import Client
from salience.core.engine.detokenizer import TextStream
from salience.core.engine.requests import Features, FinishReason, SamplingOptions, ScoredToken, TokenEvent
from salience.core.probes.monitors import MonitorEvent
from salience.core.probes.readouts import float32_row
from salience.core.serving.turns import SessionToken, Turn, TurnDone
from salience.lmtp.messages import Generate, SessionGenerate
from salience.lmtp.terms import probes_of

__all__ = [
    "finish_reason",
    "prompt_ids_payload",
    "prompt_payloads",
    "sampling_options",
    "session_payload",
    "token_payload",
    "turn",
    "turn_end_payload",
]


def finish_reason(reason: FinishReason | None, stopped_by: MonitorEvent | None) -> str | None:
    """LMTP's finish_reason: the core's, with a monitor's stop as `monitor:<concept>`."""
    if reason is FinishReason.MONITOR and stopped_by is not None:
        return f"monitor:{stopped_by.subject}"
    return reason and reason.value


def sampling_options(request: Generate) -> SamplingOptions:
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
        structured_outputs=request.structured_outputs,
    )


def turn(request: SessionGenerate, request_id: str, client: Client) -> Turn:
    return Turn(
        **client.engine_keywords(),
        offset=request.offset,
        truncating=request.truncating,
        append=request.append,
        images=request.images,
        logprob_ranges=request.logprobs,
        logprob_top_k=request.top_logprobs,
        probes=probes_of(request),
        sampling=SamplingOptions(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=max(request.top_k, 0),
            seed=request.seed,
            stop_token_ids=request.stop_token_ids,
            priority=request.priority,
            structured_outputs=request.structured_outputs,
        ),
        request_id=request_id,
    )


def token_payload(
    stream_id: int,
    token: TokenEvent | ScoredToken,
    finish_reason: str | None,
    *,
    top: bool,
    text: TextStream | None,
    readout: bool,
    encoding: str = "json",
) -> dict:
    """One TOKEN payload: the fields LMQL reads, plus the extensions the request asked for
    (`encoding`: the readout's, readout_field)."""
    payload = {
        "token": token.token_id,
        "stream_id": stream_id,
        "logprob": token.logprob,
        "finish_reason": finish_reason,
    }
    if top:
        payload["top_logprobs"] = _top_logprobs(token.top_logprobs)
    if text is not None:
        payload["text"] = text.push(token.token_id) + (text.flush() if finish_reason else "")
    if readout:
        payload["position"] = token.position
        if token.readout is not None:
            payload["readout"] = readout_field(token.readout, encoding)
    if token.residual is not None or token.features is not None:
        payload["position"] = token.position
        payload.update(row_fields(token))
    if isinstance(token, TokenEvent) and token.monitors:
        payload["position"] = token.position
        payload["monitors"] = [event.as_dict() for event in token.monitors]
    return payload


def prompt_ids_payload(stream_id: int, prompt: Sequence[int]) -> dict:
    """The prompt the chat template rendered from a request's messages, the stream's first payload:
    the client learns the ids its positions count in, and that the reply begins at their length."""
    return {"stream_id": stream_id, "prompt_ids": list(prompt)}


def prompt_payloads(
    stream_id: int, prompt: tuple[int, ...], readouts: dict, rows: dict[str, dict], encoding: str = "json"
) -> list[dict]:
    """Prompt positions' readouts and rows (PromptScores.rows), which go before any other payload,
    marked "prompt": true."""
    out = []
    for position in sorted(set(readouts).union(*rows.values())):
        payload = {
            "stream_id": stream_id,
            "token": prompt[position],
            "position": position,
            "prompt": True,
            "finish_reason": None,
        }
        if position in readouts:
            payload["readout"] = readout_field(readouts[position], encoding)
        for field, taken in rows.items():
            if position in taken:
                payload[field] = WIRE[field](taken[position])
        out.append(payload)
    return out


def readout_field(values: Sequence[float | None], encoding: str) -> list | str:
    """A readout on the wire: its JSON list, or for "f32" base64 of little-endian float32 (a null,
    a probability without calibration, as NaN), a fifth of the bytes and nothing to parse."""
    if encoding == "json":
        return list(values)
    try:  # a row as read: floats that fit (every token of every stream)
        packed = float32_row(len(values)).pack(*values)
    except (struct.error, OverflowError):  # a None (NaN), or past float32 (inf), as numpy makes them
        with np.errstate(over="ignore"):
            packed = np.array(values, dtype="<f4").tobytes()
    return base64.b64encode(packed).decode("ascii")


def residual_field(rows) -> str:
    """Residual rows on the wire: base64 of float32 [layers asked, hidden], little-endian."""
    return base64.b64encode(rows.astype("<f4", copy=False).tobytes()).decode("ascii")


def features_field(features: Features) -> list[list]:
    """An SAE's top features on the wire: [[id, activation], ...], largest first."""
    return [[feature, activation] for feature, activation in features]


WIRE = {"residual": residual_field, "features": features_field}


def row_fields(token: TokenEvent | ScoredToken | SessionToken) -> dict:
    """The token's residual rows and features, as the wire carries them, where it has them."""
    return {field: wire(getattr(token, field)) for field, wire in WIRE.items() if getattr(token, field) is not None}


def session_payload(stream_id: int, token: SessionToken, text: TextStream | None, encoding: str = "json") -> dict:
    """A session turn's TOKEN payload: prompt positions marked "prompt": true; fields only where covered."""
    payload: dict = {"stream_id": stream_id, "token": token.token_id, "position": token.position}
    if token.is_prefill:
        payload["prompt"] = True
    if token.logprob is not None:
        payload["logprob"] = token.logprob
    if token.top_logprobs:
        payload["top_logprobs"] = _top_logprobs(token.top_logprobs)
    if token.readout is not None:
        payload["readout"] = readout_field(token.readout, encoding)
    if token.monitors:
        payload["monitors"] = [event.as_dict() for event in token.monitors]
    payload.update(row_fields(token))
    if text is not None and not token.is_prefill:
        payload["text"] = text.push(token.token_id)
    payload["finish_reason"] = None
    return payload


def turn_end_payload(stream_id: int, done: TurnDone, text: TextStream | None) -> dict:
    """A session turn's terminal payload: how it ended, the text's tail, and its usage."""
    final: dict = {"stream_id": stream_id, "finish_reason": finish_reason(done.finish_reason, done.stopped_by)}
    if text is not None:
        final["text"] = text.flush()
    final["usage"] = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.total_tokens,
        "cached_tokens": done.cached_tokens,
    }
    return final


def _top_logprobs(top: tuple[tuple[int, float], ...]) -> dict[str, float]:
    # Truncated alternatives (-inf) cannot be sampled and have no JSON form.
    return {str(t): lp for t, lp in top if math.isfinite(lp)}
