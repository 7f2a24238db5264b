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
]


class SalienceError(Exception):
    """Base of every error Salience reports to a client. `retry_after`: seconds after which the
    same request may pass, which every wire sends (None: no telling; only a limit knows)."""

    retry_after: float | None = None


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
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermissionDenied(SalienceError):
    pass


class ModelError(SalienceError):
    pass


class EngineError(SalienceError):
    pass


class Unavailable(SalienceError):
    pass
