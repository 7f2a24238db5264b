"""Salience errors as gRPC status codes: the one place the mapping lives.

The wrappers also give every call its request id (the `x-request-id` metadata, else a
new one): set as the call's logging context, sent back as initial metadata, and on an
error at the end of the message (` (request_id=...)`) and as trailing metadata. An error
about one request field also carries the standard rich error (`grpc-status-details-bin`: a
google.rpc.Status holding a BadRequest whose field violation names the field).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from salience import errors, metrics, request_ids
from salience.grpc_frontend.auth import place_anonymous
from salience.grpc_frontend.error_fields import DETAILS
from salience.logs import REQUEST_ID

__all__ = ["abort", "code_for", "details", "translating", "translating_stream"]

log = logging.getLogger(__name__)

_CODES: dict[type[errors.SalienceError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ContextOverflow: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionBusy: grpc.StatusCode.ABORTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.ModelError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.EngineError: grpc.StatusCode.INTERNAL,
}


Req = TypeVar("Req")
Resp = TypeVar("Resp")


def code_for(exc: errors.SalienceError) -> grpc.StatusCode:
    for kind in type(exc).__mro__:
        if kind in _CODES:
            return _CODES[kind]
    return grpc.StatusCode.INTERNAL


def details(code: grpc.StatusCode, message: str, field: str, description: str) -> bytes:
    """The serialized google.rpc.Status of an error about `field`: `message` is the call's own
    status message (grpcio-status checks they agree), the violation's description the error's."""
    violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    return status_pb2.Status(code=code.value[0], message=message, details=[detail]).SerializeToString()


async def abort(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    kind: str,
    retry_after: float | None = None,
    field: str | None = None,
) -> None:
    """End the call with `code`, naming the request in the message and trailing metadata (with
    `retry-after`, in whole seconds, when a limit says when to come back, and a BadRequest
    naming `field`, the request field at fault); raises."""
    request_id = REQUEST_ID.get() or request_ids.new()
    metrics.ERRORS.labels("grpc", kind).inc()
    log.info("request failed", extra={"request_id": request_id, "code": code.name, "kind": kind, "error": message})
    trailers = [(request_ids.HEADER, request_id)]
    if retry_after is not None:
        trailers.append(("retry-after", str(math.ceil(retry_after))))
    sent = f"{message} (request_id={request_id})"
    if field:
        trailers.append((DETAILS, details(code, sent, field, message)))
    await context.abort(code, sent, tuple(trailers))


async def _refuse(context: grpc.aio.ServicerContext, exc: errors.SalienceError) -> None:
    await abort(context, code_for(exc), str(exc), type(exc).__name__, exc.retry_after, exc.field)


async def _begin(context: grpc.aio.ServicerContext) -> None:
    """Set the call's request id (its x-request-id metadata, else a new one) and send it back.
    Each call runs in a task of its own, so the id stays with this call."""
    place_anonymous(context)
    given = dict(context.invocation_metadata() or ()).get(request_ids.HEADER)
    REQUEST_ID.set(request_ids.new())
    if given is not None:
        request_ids.check(given, "x-request-id metadata")  # InvalidArgument, named by the new id
        REQUEST_ID.set(given)
    await context.send_initial_metadata(((request_ids.HEADER, REQUEST_ID.get()),))


async def _internal(context: grpc.aio.ServicerContext) -> None:
    log.exception("call failed")
    await abort(context, grpc.StatusCode.INTERNAL, "internal server error", "InternalError")


def translating(
    method: Callable[..., Awaitable[Resp]],
) -> Callable[..., Awaitable[Resp]]:
    """A unary servicer method whose SalienceErrors end the call with their status code."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> Resp:
        try:
            await _begin(context)
            return await method(self, request, context)
        except errors.SalienceError as exc:
            await _refuse(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal(context)

    return wrapper


def translating_stream(
    method: Callable[..., AsyncIterator[Resp]],
) -> Callable[..., AsyncIterator[Resp]]:
    """The same for a server-streaming method: an error mid-stream ends it with its code."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            await _begin(context)
            log.debug("stream started", extra={"method": method.__name__})
            # aclosing: a cancelled call must close the inner generator now (aborting
            # its engine request), not whenever it is garbage-collected.
            async with contextlib.aclosing(method(self, request, context)) as items:
                async for item in items:
                    yield item
            log.debug("stream ended", extra={"method": method.__name__})
        except errors.SalienceError as exc:
            await _refuse(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await _internal(context)

    return wrapper
