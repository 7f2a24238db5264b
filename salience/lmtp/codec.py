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
import json
import re
import sys
from array import array
from collections.abc import Iterable
from typing import Any

import orjson

from salience.errors import InvalidArgument
from salience.lmtp.fields import ALTERNATIVES, INT_LIMIT, TYPES, valid_request_id
from salience.lmtp.messages import ClientMessage, ModelInfo

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_MESSAGE_BYTES",
    "LmtpError",
    "msg_frame",
    "parse_client_line",
    "parse_server_line",
    "readout_values",
    "token_frame",
]

# The largest message parsed (--lmtp-max-message-bytes); a larger one gets an error, unparsed.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# The hard ceiling the transports read up to (--lmtp-max-frame-bytes); past it they close.
MAX_FRAME_BYTES = 256 * 1024 * 1024


class LmtpError(Exception):
    """A line the server cannot act on; `stream_id` is None if the line named none,
    `request_id` is the line's own if it holds a valid one, and `field` the message's field at
    fault (None: the line as a whole)."""

    def __init__(
        self,
        message: str,
        *,
        stream_id: int | None = None,
        kind: str | None = None,
        request_id: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.stream_id = stream_id
        self.kind = kind
        self.request_id = request_id
        self.field = field


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
    if kind not in TYPES:
        raise LmtpError(f"unknown message type {kind!r}; known: {', '.join(TYPES)}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        data = _slow_json(body, kind, exc)
    if not isinstance(data, dict):
        raise LmtpError(f"{kind}: body must be a JSON object", kind=kind)
    cls, readers, required = TYPES[kind]
    stream_id = data.get("stream_id")
    stream_id = stream_id if type(stream_id) is int and -INT_LIMIT <= stream_id < INT_LIMIT else None
    request_id = valid_request_id(data.get("request_id")) if "request_id" in readers else None
    where = {"stream_id": stream_id, "kind": kind, "request_id": request_id}
    unknown = sorted(set(data) - set(readers))
    if unknown:
        raise LmtpError(f"{kind}: unknown field {unknown[0]!r}; known: {', '.join(readers)}", field=unknown[0], **where)
    missing = sorted(name for name in required if data.get(name) is None)
    if missing:
        raise LmtpError(f"{kind}: missing field {missing[0]!r}", field=missing[0], **where)
    if kind in ALTERNATIVES:
        first, other = ALTERNATIVES[kind]
        given = [name for name in (first, other) if data.get(name) is not None]
        if not given:
            raise LmtpError(f"{kind}: missing field {first!r} (or {other!r})", field=first, **where)
        if len(given) > 1:
            raise LmtpError(f"{kind}: give {first!r} or {other!r}, not both", **where)
    fields = {}
    for name, value in data.items():
        if value is not None:
            try:
                fields[name] = readers[name](value, name)
            except InvalidArgument as exc:
                raise LmtpError(f"{kind}: {exc}", field=exc.field or name, **where) from None
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
    if kind not in TYPES:
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


def readout_values(readout: list | str) -> list[float]:
    """For clients: a payload's `readout` as numbers, whichever `readout_encoding` the request
    chose (base64 of little-endian float32 for "f32"; NaN where a value is not available)."""
    if isinstance(readout, list):
        return [float("nan") if value is None else value for value in readout]
    floats = array("f", base64.b64decode(readout))
    if sys.byteorder == "big":
        floats.byteswap()
    return floats.tolist()


def parse_server_line(line: str) -> tuple[str, list[dict]]:
    """For clients (REPL, tests): split a server frame into its type and payloads."""
    kind, sep, body = line.partition(" ")
    if not sep:
        raise LmtpError(f"expected 'TYPE <json>', got {line[:40]!r}")
    payloads = orjson.loads(body)
    if not isinstance(payloads, list):
        raise LmtpError(f"{kind}: payload must be a list")
    return kind, payloads
