"""The browser page: static files shipped in the package, served at `/ui/` by the LMTP app.

No build step: the page is plain HTML, CSS and JavaScript modules, so what is in
`static/` is exactly what the browser runs, and it works with no internet.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

__all__ = ["STATIC", "UI_PATH", "add_routes"]

STATIC = Path(__file__).with_name("static")
UI_PATH = "/ui/"


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def _to_index(request: web.Request) -> web.Response:
    raise web.HTTPFound(UI_PATH)


def add_routes(app: web.Application) -> None:
    """`/ui` and `/ui/` serve the page; everything under `/ui/` is a static file (no token needed)."""
    app.router.add_get("/ui", _to_index)
    app.router.add_get(UI_PATH, _index)
    app.router.add_static(UI_PATH, STATIC)
