"""The one error hierarchy of Salience.

Core code raises these; each frontend maps them to its wire form in one place
(gRPC status codes, LMTP error payloads).

    SalienceError
    ├── InvalidArgument       a request field is malformed or out of range
    ├── ContextOverflow       prompt (plus decode budget) exceeds max_model_len
    ├── NotFound              unknown or evicted session
    ├── FailedPrecondition    offset drift, image-block split
    ├── SessionBusy           a Generate is already running on the session
    ├── ResourceExhausted     server-side limits (sessions, stored tokens, concept columns), a client's limits
    ├── PermissionDenied      a request outside its client's scopes
    ├── ModelError            the model folder cannot be served
    ├── Unavailable           the model is loading or the server is stopping
    └── EngineError           the engine failed while serving a request
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

__all__ = [
    "ContextOverflow",
    "EngineError",
    "FailedPrecondition",
    "InvalidArgument",
    "ModelError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SalienceError",
    "SessionBusy",
    "Unavailable",
    "first_name",
    "join",
    "renamed",
    "under",
]


class SalienceError(Exception):
    """Base of every error Salience reports to a client.

    `field`: the request field at fault, as a path relative to what the raising code was handed
    (`steer[2].value`, `messages[1].role`; None: the request as a whole). A caller that handed it
    a part of a request prefixes the path (`under`), and each wire reports it its own way (OpenAI's
    `param`, the LMTP error's `field`, a gRPC BadRequest field violation), so no frontend reads
    a field out of a message. `retry_after`: seconds after which the same request may pass, which
    every wire sends (None: no telling; only a limit knows)."""

    retry_after: float | None = None
    field: str | None = None

    def __init__(self, message: str, *, field: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.field = field
        if retry_after is not None:
            self.retry_after = retry_after


class InvalidArgument(SalienceError):
    pass


class ContextOverflow(SalienceError):
    pass


class NotFound(SalienceError):
    pass


class FailedPrecondition(SalienceError):
    pass


class SessionBusy(SalienceError):
    pass


class ResourceExhausted(SalienceError):
    def __init__(self, message: str, retry_after: float | None = None, *, field: str | None = None) -> None:
        super().__init__(message, field=field, retry_after=retry_after)


class PermissionDenied(SalienceError):
    pass


class ModelError(SalienceError):
    pass


class EngineError(SalienceError):
    pass


class Unavailable(SalienceError):
    pass


def join(prefix: str, field: str | None) -> str | None:
    """`field` as a path inside `prefix`: `salience` + `steer[2].value`, `messages` + `[1].role`
    (None: no field at all)."""
    if not field:
        return prefix or None
    if not prefix:
        return field
    return prefix + field if field.startswith("[") else f"{prefix}.{field}"


def first_name(field: str) -> str:
    """`steer` of `steer[2].value`, `salience` of `salience.monitors`."""
    return field.partition(".")[0].partition("[")[0]


def renamed(field: str | None, names: Mapping[str, str] | None) -> str | None:
    """`field` with its first name as `names` spell it (`steer[2].value` -> `interventions[2].value`)."""
    if names and field and (head := first_name(field)) in names:
        return names[head] + field[len(head) :]
    return field


@contextlib.contextmanager
def under(prefix: str = "", names: Mapping[str, str] | None = None) -> Iterator[None]:
    """Errors raised inside name their field within `prefix` (a caller that handed part of a
    request to code naming fields relative to that part). `names` first renames a field's first
    name, for a wire that calls it otherwise (gRPC's `interventions` for core's `steer`)."""
    try:
        yield
    except SalienceError as exc:
        exc.field = join(prefix, renamed(exc.field, names))
        raise
