"""LMTP wire format, sans I/O: one message is one line `TYPE <json>`.

`parse_client_line` turns a line into a typed message or raises LmtpError,
which carries the stream_id when the line got far enough to name one, so the
error can be routed to that stream. `token_frame` / `msg_frame` serialize
server frames. Every transport (WebSocket, TCP) and the REPL use these.

Validation here is about shape (types, ranges that hold for any model); what
depends on the model (vocabulary, context length, top-k limit) is checked by
the core engine, once for every frontend.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import orjson

from salience import request_ids
from salience.core.engine.requests import ImageBlock
from salience.core.probes.calibration import Monitor, parse_monitors
from salience.core.probes.steering import Intervention, parse_interventions, parse_vector
from salience.errors import InvalidArgument
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
    SaveConcepts,
    Score,
    SessionGenerate,
    Status,
    Tokenize,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "LmtpError",
    "msg_frame",
    "parse_client_line",
    "parse_server_line",
    "token_frame",
]

# The largest message parsed (--lmtp-max-message-bytes); a larger one gets an error, unparsed.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# The hard ceiling the transports read up to (--lmtp-max-frame-bytes); past it they close.
MAX_FRAME_BYTES = 256 * 1024 * 1024
_INT_LIMIT = 2**63


class LmtpError(Exception):
    """A line the server cannot act on; `stream_id` is None if the line named none, and
    `request_id` is the line's own if it holds a valid one."""

    def __init__(
        self, message: str, *, stream_id: int | None = None, kind: str | None = None, request_id: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.stream_id = stream_id
        self.kind = kind
        self.request_id = request_id


# ---- field readers: each raises a message naming the field -------------------


def _int(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    if type(value) is not int:
        raise ValueError(f"{name} must be an integer, got {_show(value)}")
    if not -_INT_LIMIT <= value < _INT_LIMIT:
        raise ValueError(f"{name} is out of range: {value}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {_show(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _bool(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{name} must be true or false, got {_show(value)}")
    return value


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {_show(value)}")
    return value


def _request_id(value: Any, name: str) -> str:
    try:
        return request_ids.check(value, name)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


def _valid_request_id(value: Any) -> str | None:
    """A line's request_id if it is valid, so an error about the line's other fields can name it."""
    try:
        return request_ids.check(value)
    except InvalidArgument:
        return None


def _tokens(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of token ids, got {_show(value)}")
    for i, token in enumerate(value):
        if type(token) is not int or token < 0 or token >= _INT_LIMIT:
            raise ValueError(f"{name}[{i}] must be a non-negative integer token id, got {_show(token)}")
    return tuple(value)


def _bias(value: Any, name: str) -> Mapping[int, float]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object of token id -> bias, got {_show(value)}")
    bias = {}
    for key, amount in value.items():
        if not (key.isascii() and key.isdigit()):
            raise ValueError(f"{name} key {key!r} is not a non-negative token id")
        bias[int(key)] = _number(amount, f"{name}[{key}]")
    return MappingProxyType(bias)


def _ranges(value: Any, name: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of [start, end] position ranges, got {_show(value)}")
    ranges = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            raise ValueError(f"{name}[{i}] must be [start, end] with integer positions, got {_show(pair)}")
        if not 0 <= pair[0] < pair[1] < _INT_LIMIT:
            raise ValueError(f"{name}[{i}] must satisfy 0 <= start < end, got {_show(pair)}")
        ranges.append((pair[0], pair[1]))
    return tuple(ranges)


def _base64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a base64 string, got {_show(value)}")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise ValueError(f"{name} is not valid base64") from None


def _images(value: Any, name: str) -> tuple[ImageBlock, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of images, got {_show(value)}")
    images = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict) or set(item) != {"data", "mime", "start", "end"}:
            raise ValueError(f'{where} must be {{"data": base64, "mime", "start", "end"}}, got {_show(item)}')
        images.append(
            ImageBlock(
                start=_int(item["start"], f"{where}.start", 0),
                end=_int(item["end"], f"{where}.end", 0),
                data=_base64(item["data"], f"{where}.data"),
                mime=_str(item["mime"], f"{where}.mime"),
            )
        )
    return tuple(images)


def _steer(value: Any, name: str) -> tuple[Intervention, ...]:
    """The shape of each intervention; names, layers and values are the engine's to check."""
    try:
        return parse_interventions(value)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


def _monitors(value: Any, name: str) -> tuple[Monitor, ...]:
    """The shape of each monitor; concepts and layers are the engine's to check."""
    try:
        return parse_monitors(value)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


def _readout_format(value: Any, name: str) -> str:
    if value not in READOUT_FORMATS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, READOUT_FORMATS))}, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = orjson.dumps(value).decode() if isinstance(value, (dict, list, str, int, float, bool, type(None))) else "?"
    return text if len(text) <= 40 else text[:37] + "..."


_Reader = Callable[[Any, str], Any]
READOUT_FORMATS = ("raw", "probability")
_GENERATE: dict[str, _Reader] = {
    "stream_id": _int,
    "prompt": _tokens,
    "model": _str,
    "max_tokens": lambda v, n: _int(v, n, 1),
    "temperature": _number,
    "top_p": _number,
    "top_k": lambda v, n: _int(v, n, -1),
    "seed": _int,
    "logit_bias": _bias,
    "top_logprobs": lambda v, n: _int(v, n, 0),
    "repetition_penalty": _number,
    "presence_penalty": _number,
    "frequency_penalty": _number,
    "length_penalty": _number,
    "stop_token_ids": _tokens,
    "priority": lambda v, n: _int(v, n, -(2**31), 2**31 - 1),
    "ignore_eos": _bool,
    "text": _bool,
    "readout": _ranges,
    "request_id": _request_id,
    "steer": _steer,
    "readout_format": _readout_format,
    "monitors": _monitors,
}
_SCORE: dict[str, _Reader] = {
    "stream_id": _int,
    "prompt": _tokens,
    "scored": _tokens,
    "model": _str,
    "top_logprobs": lambda v, n: _int(v, n, 0),
    "text": _bool,
    "readout": _ranges,
    "request_id": _request_id,
    "steer": _steer,
    "readout_format": _readout_format,
}
_SESSION_GENERATE: dict[str, _Reader] = {
    "stream_id": _int,
    "session_id": _str,
    "offset": lambda v, n: _int(v, n, 0),
    "truncating": _bool,
    "append": _tokens,
    "max_tokens": lambda v, n: _int(v, n, 0),
    "logprobs": _ranges,
    "top_logprobs": lambda v, n: _int(v, n, 0),
    "readout": _ranges,
    **{
        name: _GENERATE[name]
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop_token_ids",
            "priority",
            "text",
            "request_id",
            "steer",
            "readout_format",
            "monitors",
        )
    },
    "images": _images,
}


def _texts(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name} must be a list of texts")
    return tuple(value)


def _layer_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise ValueError(f"{name} must be a list of layer indices")
    return tuple(value)


def _vector(value: Any, name: str) -> bytes:
    try:
        return parse_vector(name, value)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None


def _vectors(value: Any, name: str) -> dict[int, bytes]:
    """{"<layer>": vector, ...}: JSON keys are strings."""
    if not isinstance(value, dict) or not value:
        raise ValueError(f'{name} must be an object {{"<layer>": vector, ...}}')
    out = {}
    for key, vector in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ValueError(f"{name}: {key!r} is not a layer index")
        out[int(key)] = _vector(vector, f"{name}[{key}]")
    return out


_DEFINE_CONCEPT: dict[str, _Reader] = {
    "stream_id": _int,
    "name": _str,
    "positive": _texts,
    "negative": _texts,
    "method": _str,
    "layers": _layer_list,
    "vector": _vector,
    "vectors": _vectors,
}
_SESSION_ID = {"stream_id": _int, "session_id": _str}
_TYPES: dict[str, tuple[type, dict[str, _Reader], frozenset[str]]] = {
    "GENERATE": (Generate, _GENERATE, frozenset({"stream_id", "prompt"})),
    "SCORE": (Score, _SCORE, frozenset({"stream_id", "prompt", "scored"})),
    # LMQL sends {"stream_id", "model", "data": {"model": ...}}.
    "MODEL_INFO": (ModelInfo, {"stream_id": _int, "model": _str, "data": lambda v, n: v}, frozenset()),
    "CANCEL": (Cancel, {"stream_id": _int}, frozenset({"stream_id"})),
    "STATUS": (Status, {"stream_id": _int}, frozenset({"stream_id"})),
    "TOKENIZE": (
        Tokenize,
        {"stream_id": _int, "text": _str, "add_special_tokens": _bool},
        frozenset({"stream_id", "text"}),
    ),
    "DETOKENIZE": (Detokenize, {"stream_id": _int, "tokens": _tokens}, frozenset({"stream_id", "tokens"})),
    "OPEN_SESSION": (OpenSession, {"stream_id": _int, "model": _str}, frozenset({"stream_id"})),
    "CLOSE_SESSION": (CloseSession, _SESSION_ID, frozenset(_SESSION_ID)),
    "DUMP_SESSION": (DumpSession, _SESSION_ID, frozenset(_SESSION_ID)),
    "FORK_SESSION": (
        ForkSession,
        {**_SESSION_ID, "at_position": lambda v, n: _int(v, n, 0)},
        frozenset({*_SESSION_ID, "at_position"}),
    ),
    "SESSION_GENERATE": (SessionGenerate, _SESSION_GENERATE, frozenset({*_SESSION_ID, "offset"})),
    "DEFINE_CONCEPT": (DefineConcept, _DEFINE_CONCEPT, frozenset({"stream_id", "name"})),
    "DELETE_CONCEPT": (DeleteConcept, {"stream_id": _int, "name": _str}, frozenset({"stream_id", "name"})),
    "SAVE_CONCEPTS": (SaveConcepts, {"stream_id": _int}, frozenset({"stream_id"})),
    "IMAGE_INFO": (
        ImageInfo,
        {"stream_id": _int, "data": _base64, "mime": _str},
        frozenset({"stream_id", "data", "mime"}),
    ),
}


def parse_client_line(line: str | bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> ClientMessage:
    """Parse one client line; raise LmtpError with a message fit to send back.

    A line over `max_bytes` is not parsed: the error names its type and stream_id if they can
    be found cheaply (see _oversized), so it can still go to the stream it belongs to."""
    if isinstance(line, str):
        line = line.encode("utf-8", "surrogatepass")
    line = line.rstrip(b"\r\n")
    if len(line) > max_bytes:
        raise _oversized(line, max_bytes)
    kind_bytes, sep, body = line.partition(b" ")
    try:
        kind = kind_bytes.decode("ascii")
    except UnicodeDecodeError:
        raise LmtpError("message type is not ASCII: expected 'TYPE <json>'") from None
    if not sep:
        raise LmtpError(f"expected 'TYPE <json>', got {_preview(line)}")
    if kind not in _TYPES:
        raise LmtpError(f"unknown message type {kind!r}; known: {', '.join(_TYPES)}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        data = _slow_json(body, kind, exc)
    if not isinstance(data, dict):
        raise LmtpError(f"{kind}: body must be a JSON object", kind=kind)
    cls, readers, required = _TYPES[kind]
    stream_id = data.get("stream_id")
    stream_id = stream_id if type(stream_id) is int and -_INT_LIMIT <= stream_id < _INT_LIMIT else None
    request_id = _valid_request_id(data.get("request_id")) if "request_id" in readers else None
    where = {"stream_id": stream_id, "kind": kind, "request_id": request_id}
    unknown = sorted(set(data) - set(readers))
    if unknown:
        raise LmtpError(f"{kind}: unknown field {unknown[0]!r}; known: {', '.join(readers)}", **where)
    missing = sorted(name for name in required if data.get(name) is None)
    if missing:
        raise LmtpError(f"{kind}: missing field {missing[0]!r}", **where)
    try:
        fields = {name: readers[name](value, name) for name, value in data.items() if value is not None}
    except ValueError as exc:
        raise LmtpError(f"{kind}: {exc}", **where) from None
    if cls is ModelInfo:
        fields.pop("data", None)  # LMQL's copy of the model name
    return cls(**fields)


_STREAM_ID = re.compile(rb'"stream_id"\s*:\s*(-?\d{1,18})\b')
_CANDIDATES = 16  # "stream_id" keys tried in an oversized message: a valid one holds one


def _oversized(line: bytes, limit: int) -> LmtpError:
    """The error for a message over the limit, without parsing it: its type is its first word,
    and its stream_id the first `"stream_id": N` found by a plain byte search (the key is
    usually near the start, or last, where LMQL writes it; a JSON string cannot hold the key
    unescaped, and a value "stream_id" has no colon after it)."""
    kind_bytes, sep, _ = line[:32].partition(b" ")
    kind = kind_bytes.decode("ascii", "replace") if sep else ""
    if kind not in _TYPES:
        kind = ""
    stream_id, start = None, 0
    for _ in range(_CANDIDATES if kind else 0):
        at = line.find(b'"stream_id"', start)
        if at < 0:
            break
        found = _STREAM_ID.match(line, at)
        if found is not None:
            stream_id = int(found.group(1))
            break
        start = at + 1
    what = f"{kind} message" if kind else "message"
    return LmtpError(
        f"{what} of {len(line)} bytes exceeds the limit of {limit} bytes (--lmtp-max-message-bytes)",
        stream_id=stream_id,
        kind=kind or None,
    )


def _slow_json(body: bytes, kind: str, error: Exception) -> Any:
    """orjson rejects some valid JSON (1e999); else name the stream if we can, so its client hears."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        pass
    found = _STREAM_ID.search(body)
    stream_id = int(found.group(1)) if found else None
    raise LmtpError(f"{kind}: body is not valid JSON ({error})", stream_id=stream_id, kind=kind)


def _preview(line: bytes) -> str:
    text = line[:40].decode("utf-8", "replace")
    return repr(text + ("..." if len(line) > 40 else ""))


def _frame(kind: str, payloads: Iterable[dict]) -> str:
    return kind + " " + orjson.dumps(list(payloads)).decode()


def token_frame(payloads: Iterable[dict]) -> str:
    return _frame("TOKEN", payloads)


def msg_frame(payloads: Iterable[dict]) -> str:
    return _frame("MSG", payloads)


def parse_server_line(line: str) -> tuple[str, list[dict]]:
    """For clients (REPL, tests): split a server frame into its type and payloads."""
    kind, sep, body = line.partition(" ")
    if not sep:
        raise LmtpError(f"expected 'TYPE <json>', got {line[:40]!r}")
    payloads = orjson.loads(body)
    if not isinstance(payloads, list):
        raise LmtpError(f"{kind}: payload must be a list")
    return kind, payloads
