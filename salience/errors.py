"""The one error hierarchy of Salience.

Core code raises these; each frontend maps them to its wire form in one place
(gRPC status codes, LMTP error payloads).

    SalienceError
    ├── InvalidArgument       a request field is malformed or out of range
    ├── ContextOverflow       prompt (plus decode budget) exceeds max_model_len
    ├── NotFound              unknown or evicted session
    ├── FailedPrecondition    offset drift, image-block split
    ├── SessionBusy           a Generate is already running on the session
    ├── ResourceExhausted     server-side limits (sessions, stored tokens, concept columns)
    ├── PermissionDenied      an operator's act (live concepts) asked with an ordinary token
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
    """Base of every error Salience reports to a client."""


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
    pass


class PermissionDenied(SalienceError):
    pass


class ModelError(SalienceError):
    pass


class EngineError(SalienceError):
    pass


class Unavailable(SalienceError):
    pass
