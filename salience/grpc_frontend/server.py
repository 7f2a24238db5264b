"""Build and start the gRPC server: the Salience service, health checking and reflection."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from salience.auth import Tokens
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.grpc_frontend.auth import ClientInterceptor
from salience.grpc_frontend.extensions import ExtensionsService
from salience.grpc_frontend.service import SalienceService
from salience.proto.salience.ext.v1 import extensions_pb2, extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2, salience_pb2_grpc

__all__ = ["SERVICE_NAME", "GrpcServer", "start_grpc_server"]

SERVICE_NAME = salience_pb2.DESCRIPTOR.services_by_name["Salience"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a 200K-token session dump, or a few images


class GrpcServer:
    """A started server and its health status; `serving()` once the model is ready."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: health.aio.HealthServicer) -> None:
        self.server = server
        self.port = port
        self._health = health_servicer

    async def serving(self, ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        await self.serving(False)
        await self.server.stop(grace)


async def start_grpc_server(
    status: ServerStatus,
    sessions: SessionStore,
    host: str,
    port: int,
    tokens: Tokens | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> GrpcServer:
    """Listen on host:port (0 picks a free port; behind TLS with `credentials`) and report
    NOT_SERVING until `serving(True)`."""
    tokens = tokens or Tokens()
    server = grpc.aio.server(
        interceptors=[ClientInterceptor(tokens)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    salience_pb2_grpc.add_SalienceServicer_to_server(SalienceService(status, sessions), server)
    extensions_pb2_grpc.add_SalienceExtensionsServicer_to_server(ExtensionsService(status, sessions), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        SERVICE_NAME,
        extensions_pb2.DESCRIPTOR.services_by_name["SalienceExtensions"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    started = GrpcServer(server, bound, health_servicer)
    await started.serving(False)
    return started
