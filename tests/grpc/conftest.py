"""A gRPC server on the tiny model with a concept set, shared by a test module."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import pytest_asyncio

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionLimits, SessionStore
from salience.core.serving.status import ServerStatus
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.grpc_frontend.server import GrpcServer, start_grpc_server

MODEL = "tiny"


@dataclass
class Served:
    engine: Engine
    status: ServerStatus
    sessions: SessionStore
    server: GrpcServer

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"


ServerFactory = Callable[..., AbstractAsyncContextManager[Served]]


@pytest_asyncio.fixture(scope="module")
async def grpc_engine(read_engine: Engine) -> Engine:
    assert read_engine.model_name == MODEL
    return read_engine


@pytest_asyncio.fixture(scope="module")
async def serve_grpc(grpc_engine: Engine) -> ServerFactory:
    """Start another server on the module's engine, with its own sessions, limits and token."""

    @asynccontextmanager
    async def serve(limits: SessionLimits | None = None, token: str | None = None) -> AsyncIterator[Served]:
        status = ServerStatus(MODEL, {"tiny-alias"})
        status.ready(grpc_engine)
        sessions = SessionStore(status.serving_engine, limits)
        server = await start_grpc_server(status, sessions, "127.0.0.1", 0, Tokens(token))
        await server.serving(True)
        try:
            yield Served(grpc_engine, status, sessions, server)
        finally:
            await server.stop(0)

    return serve


@pytest_asyncio.fixture(scope="module")
async def served(serve_grpc: ServerFactory) -> AsyncIterator[Served]:
    async with serve_grpc() as served:
        yield served


@pytest_asyncio.fixture
async def client(served: Served) -> AsyncIterator[AsyncSalienceClient]:
    async with AsyncSalienceClient(served.target) as client:
        yield client
