"""Bearer-token check on every RPC, as a server interceptor (grpc's examples/python/auth)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from salience import metrics, request_ids
from salience.auth import Tokens
from salience.errors import InvalidArgument

__all__ = ["BearerAuthInterceptor"]

# Load balancers probe health without credentials.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


async def _deny(request: object, context: grpc.aio.ServicerContext) -> None:
    request_id = dict(context.invocation_metadata() or ()).get(request_ids.HEADER)
    try:
        request_id = request_ids.check(request_id)
    except InvalidArgument:
        request_id = request_ids.new()
    await context.abort(
        grpc.StatusCode.UNAUTHENTICATED,
        f"missing or wrong bearer token (authorization metadata) (request_id={request_id})",
        ((request_ids.HEADER, request_id),),
    )


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens
        self._deny = grpc.unary_unary_rpc_method_handler(_deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        if self._tokens.admits(metadata.get("authorization", "")):
            return await continuation(handler_call_details)
        metrics.AUTH_FAILURES.labels("grpc").inc()
        return self._deny
