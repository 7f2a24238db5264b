"""OpenAI's error object, and Salience's errors as HTTP statuses: the one place the mapping lives.

Every error the OpenAI API sends is `{"error": {"message", "type", "param", "code"}}` with the
status the official `openai` client turns into its exception class (400 BadRequestError,
401 AuthenticationError, 404 NotFoundError, 429 RateLimitError, 5xx InternalServerError).
`param` names the request field at fault where one is (`temperature`, `messages[2].role`,
`salience.monitors`), as OpenAI's own server does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from salience import errors

__all__ = ["ApiError", "bad_request", "from_salience", "naming", "unauthorized"]


# status, type and code per Salience error class; `type` strings are OpenAI's own.
_STATUS: dict[type[errors.SalienceError], tuple[int, str, str | None]] = {
    errors.InvalidArgument: (400, "invalid_request_error", None),
    errors.ContextOverflow: (400, "invalid_request_error", "context_length_exceeded"),
    errors.NotFound: (404, "invalid_request_error", "not_found"),
    errors.FailedPrecondition: (400, "invalid_request_error", None),
    errors.SessionBusy: (409, "invalid_request_error", None),
    errors.ResourceExhausted: (429, "rate_limit_error", "rate_limit_exceeded"),
    errors.PermissionDenied: (403, "permission_error", None),
    errors.ModelError: (500, "server_error", None),
    errors.Unavailable: (503, "server_error", "unavailable"),
    errors.EngineError: (500, "server_error", None),
}


@dataclass(eq=False)
class ApiError(Exception):
    """An error as the OpenAI API reports it: the HTTP status and the error object's fields."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    kind: str = "InvalidArgument"  # what salience_errors_total counts it as
    retry_after: float | None = None  # seconds, for a 429 (its Retry-After header)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unauthorized() -> ApiError:
    """What OpenAI answers a missing or wrong API key with (its `code`, and an error object, not plain text)."""
    return ApiError(
        401,
        "missing or wrong bearer token (Authorization: Bearer ...)",
        code="invalid_api_key",
        kind="Unauthorized",
    )


def from_salience(exc: errors.SalienceError, param: str | None = None) -> ApiError:
    status, kind, code = next((_STATUS[k] for k in type(exc).__mro__ if k in _STATUS), (500, "server_error", None))
    return ApiError(status, str(exc), kind, param, code, type(exc).__name__, exc.retry_after)


@contextlib.contextmanager
def naming(
    param: str | None = None,
    *,
    fields: Mapping[str, str] | None = None,
    status: int | None = None,
    code: str | None = None,
) -> Iterator[None]:
    """Raise a SalienceError from inside as an ApiError about `param`. An error whose `field` the
    request has at a known place names the param more closely: `fields` maps the field's first
    name to the prefix its param is joined under (by default `param`'s own name, unprefixed:
    `messages[2].role` under `messages`); any other field is not the request's own spelling, and
    the param stays `param`. `status` and `code` override the mapping's (a model that is not
    served: 404 `model_not_found`)."""
    known = fields if fields is not None else ({param: ""} if param else {})
    try:
        yield
    except errors.SalienceError as exc:
        error = from_salience(exc, param)
        field = exc.field
        if field and (prefix := known.get(errors.first_name(field))) is not None:
            error.param = errors.join(prefix, field)
        if status is not None:
            error.status = status
        if code is not None:
            error.code = code
        raise error from None
