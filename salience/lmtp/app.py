"""The aiohttp application: health endpoint now, the LMTP WebSocket and the page later."""

from __future__ import annotations

from aiohttp import web

from salience.core.status import Phase, ServerStatus

__all__ = ["STATUS", "make_app"]

STATUS = web.AppKey("status", ServerStatus)


async def health(request: web.Request) -> web.Response:
    """200 once the engine is loaded and warmed up; 503 while loading or stopping."""
    status = request.app[STATUS]
    body = {"status": status.phase.value, "model": status.model_name}
    return web.json_response(body, status=200 if status.phase is Phase.READY else 503)


def make_app(status: ServerStatus) -> web.Application:
    app = web.Application()
    app[STATUS] = status
    app.router.add_get("/health", health)
    return app
