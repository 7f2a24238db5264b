"""Request ids: the one string that follows a request from the socket to vLLM's logs.

A client may choose it (LMTP `request_id` field, `x-request-id` on the WebSocket upgrade or in
gRPC metadata); otherwise the server makes one (uuid4 hex). Every log line written while the
request is served carries it (salience.logs.REQUEST_ID), every error and terminal payload the
client gets names it, and vLLM gets it as its request id (which vLLM suffixes with `-<8 hex>`).
"""

from __future__ import annotations

import re
import uuid

from salience.errors import InvalidArgument

__all__ = ["HEADER", "MAX_LENGTH", "check", "new"]

HEADER = "x-request-id"  # HTTP header and gRPC metadata key
MAX_LENGTH = 128
_ALLOWED = re.compile(r"[A-Za-z0-9._:-]+")


def new() -> str:
    return uuid.uuid4().hex


def check(value: object, what: str = "request_id") -> str:
    """`value` if it is a usable request id, else InvalidArgument saying what is wrong."""
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty string", field=what)
    if len(value) > MAX_LENGTH:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {MAX_LENGTH} are allowed", field=what)
    if not _ALLOWED.fullmatch(value):
        raise InvalidArgument(f"{what} may only hold the characters A-Z a-z 0-9 . _ : -", field=what)
    return value
