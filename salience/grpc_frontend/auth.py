"""Every call's client, from its bearer token, and its method's scopes, checked in a server
interceptor (grpc's examples/python/auth) before any handler runs. The handler finds the client
in `CLIENT`: the interceptor runs in the call's own task, so the context variable carries over."""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Awaitable, Callable

import grpc

from salience import metrics, request_ids
from salience.auth import ANONYMOUS, Client, Tokens
from salience.errors import InvalidArgument, PermissionDenied
from salience.logs import CLIENT_NAME
from salience.scopes import OPEN, OPERATIONS, needs

__all__ = ["CLIENT", "ClientInterceptor", "place_anonymous"]

CLIENT: contextvars.ContextVar[Client] = contextvars.ContextVar("grpc_client")


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        request_id = dict(context.invocation_metadata() or ()).get(request_ids.HEADER)
        try:
            request_id = request_ids.check(request_id)
        except InvalidArgument:
            request_id = request_ids.new()
        await context.abort(code, f"{message} (request_id={request_id})", ((request_ids.HEADER, request_id),))

    return grpc.unary_unary_rpc_method_handler(refuse)


_UNAUTHENTICATED = _refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (authorization metadata)")


def place_anonymous(context: grpc.aio.ServicerContext) -> None:
    """The anonymous client of an open server is counted per peer address (fair share), which only
    the call's context knows, not the interceptor: the handler's wrapper calls this first. The
    address is written as the other wires write it (`::1`, unbracketed): it owns sessions on all."""
    client = CLIENT.get(None)
    if client is not None and client.name == ANONYMOUS and client.peer is None:
        peer = context.peer() or ""  # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555"
        CLIENT.set(dataclasses.replace(client, peer=peer.partition(":")[2].rpartition(":")[0].strip("[]") or None))


class ClientInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method.lstrip("/")
        # Load balancers probe health without credentials. A method outside the table has no
        # handler (gRPC answers UNIMPLEMENTED): the table lists every one served (tests/test_scopes.py).
        if OPERATIONS.get(method, OPEN) == OPEN:
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        client = self._tokens.identify(metadata.get("authorization"))
        if client is None:
            metrics.AUTH_FAILURES.labels("grpc").inc()
            return _UNAUTHENTICATED
        try:
            client.require(needs(method))
        except PermissionDenied as exc:
            metrics.ERRORS.labels("grpc", "PermissionDenied").inc()
            return _refusal(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        CLIENT.set(client)
        CLIENT_NAME.set(client.name)
        return await continuation(handler_call_details)
