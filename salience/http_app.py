"""The HTTP application on the LMTP port: LMTP over WebSocket at `/` (salience.lmtp), the OpenAI API
at `/v1/` (salience.openai), `GET /health`, `GET /metrics` and the page at `/ui/` (salience.ui).
Each frontend adds its own routes; this module only composes them, so no frontend imports another.
"""

from __future__ import annotations

from aiohttp import web

from salience import metrics
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import Phase, ServerStatus
from salience.lmtp import websocket
from salience.lmtp.config import LmtpConfig
from salience.openai import app as openai_app
from salience.ui import add_routes as add_page

__all__ = ["make_app", "make_metrics_app"]


async def health(request: web.Request) -> web.Response:
    """200 once the engine is loaded and warmed up; 503 while loading, draining or stopping."""
    status = request.app[websocket.STATUS]
    body = {"status": status.phase.value, "model": status.model_name}
    return web.json_response(body, status=200 if status.phase is Phase.READY else 503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus text format, behind the bearer token when the server has one."""
    tokens = request.app[websocket.LMTP_CONFIG].tokens
    if tokens.identify(request.headers.get("Authorization"), request.query.get("token")) is None:
        metrics.AUTH_FAILURES.labels("metrics").inc()
        raise web.HTTPUnauthorized(
            headers={"WWW-Authenticate": "Bearer"}, text="unauthorized: missing or wrong bearer token"
        )
    return await open_metrics(request)


async def open_metrics(request: web.Request) -> web.Response:
    return web.Response(body=metrics.exposition(), headers={"Content-Type": metrics.CONTENT_TYPE})


def make_metrics_app() -> web.Application:
    """`GET /metrics` alone, without auth: for --metrics-port, on a network only operators reach."""
    app = web.Application()
    app.router.add_get("/metrics", open_metrics)
    return app


def make_app(status: ServerStatus, config: LmtpConfig, sessions: SessionStore | None = None) -> web.Application:
    """The app; `sessions` is shared with the other frontends (by default the app has its own).
    An HTTP body (the OpenAI API's) may be as large as an LMTP message."""
    app = web.Application(client_max_size=config.limits.max_message_bytes)
    sessions = sessions if sessions is not None else SessionStore(status.serving_engine)
    websocket.add_routes(app, status, config, sessions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    openai_app.add_routes(app, status, config.tokens, sessions)
    add_page(app)
    return app
