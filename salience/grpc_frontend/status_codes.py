"""Salience errors as gRPC status codes: the one place the mapping lives."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from salience import errors

__all__ = ["code_for", "translating", "translating_stream"]

_CODES: dict[type[errors.SalienceError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ContextOverflow: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.SessionBusy: grpc.StatusCode.ABORTED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
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


def translating(
    method: Callable[..., Awaitable[Resp]],
) -> Callable[..., Awaitable[Resp]]:
    """A unary servicer method whose SalienceErrors end the call with their status code."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await method(self, request, context)
        except errors.SalienceError as exc:
            await context.abort(code_for(exc), str(exc))  # raises

    return wrapper


def translating_stream(
    method: Callable[..., AsyncIterator[Resp]],
) -> Callable[..., AsyncIterator[Resp]]:
    """The same for a server-streaming method: an error mid-stream ends it with its code."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
        try:
            # aclosing: a cancelled call must close the inner generator now (aborting
            # its engine request), not whenever it is garbage-collected.
            async with contextlib.aclosing(method(self, request, context)) as items:
                async for item in items:
                    yield item
        except errors.SalienceError as exc:
            await context.abort(code_for(exc), str(exc))

    return wrapper
