"""The page's end-to-end fixtures: one engine on the default model, one headless Chromium.

The server runs in-process (as in tests/lmtp/conftest.py) so a test can build a second app
on the same engine to walk the page through loading, ready, lost and unauthorized. Chromium
is Debian's (`tools/setup_browser.sh`, run by `make test`, installs it); Playwright's own
browser download is never used. Every test leaves a screenshot in artifacts/ui/.
"""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, Page, WebSocketRoute, async_playwright, expect

from salience.core.engine.engine import Engine
from salience.core.probes.concepts import ConceptSet
from salience.core.serving.status import ServerStatus
from salience.http_app import make_app
from salience.lmtp.codec import parse_server_line, readout_values
from salience.lmtp.session import LmtpConfig
from tests.conftest import free_port

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "ui"
COMPLETION = "ui/#completion"  # the page in its completion view (on a chat model it opens in chat)
CHROMIUM = Path("/usr/bin/chromium")
# Decoding shares two cores with whatever else runs: waits are generous, passing tests are not slowed.
expect.set_options(timeout=60_000)
# What the page says of position 0 in a probability view (salience/ui/static/js/heatmap.js).
NOT_READ = "not read: the first token holds the model's attention-sink activations, which say nothing about the text"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _logistic(x: float) -> float:
    return 0.5 * (1 + math.tanh(x / 2))


def probabilities(manifest: dict, readouts: dict[int, list[float]]) -> tuple[dict, dict]:
    """The running and the token view of every (position, concept) at the concept's recommended layer,
    as the server defines them (salience/core/probes/calibration.py), from the raw values the page
    received for one stream (`readouts`: position -> raw row): running, the running map of the mean
    raw value over the stream's positions up to this one (positions 1..t from the start of a text, or
    a chat turn's from its first); token, the token map of the position's own. Position 0 is read in
    neither, nor counted."""
    concepts, layers, info = manifest["concepts"], manifest["layers"], manifest["concept_info"]
    running, token = {}, {}
    for k, concept in enumerate(info):
        i = layers.index(concept["recommended_layer"])
        fit = next(f for f in concept["layers"] if f["layer"] == concept["recommended_layer"])
        total, count = 0.0, 0
        for position in sorted(readouts):
            if position == 0:
                continue
            raw = readouts[position][i * len(concepts) + k]
            total += raw
            count += 1
            running[(position, k)] = _logistic(fit["running_scale"] * (total / count) + fit["running_offset"])
            token[(position, k)] = _logistic(fit["scale"] * raw + fit["offset"])
    return running, token


@pytest.fixture(scope="module")
def concepts(default_concepts: ConceptSet) -> ConceptSet:
    return default_concepts


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine


async def serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest_asyncio.fixture(scope="module")
async def server(engine: Engine) -> AsyncIterator[str]:
    """The base URL of a ready server."""
    status = ServerStatus(engine.model_name)
    status.ready(engine)
    port = free_port()
    runner = await serve(make_app(status, LmtpConfig()), port)
    yield f"http://127.0.0.1:{port}/"
    await runner.cleanup()


@pytest_asyncio.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` (tools/setup_browser.sh) installs Debian's chromium")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        await browser.close()


@dataclass
class Ui:
    """A page, with what its console reported and every LMTP line it sent and received."""

    page: Page
    name: str  # the test's, for screenshot files
    errors: list[str] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    received: list[tuple[str, list[dict]]] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)  # URL of every WebSocket opened

    async def rewrite_model_info(self, **changes: object) -> None:
        """Change MODEL_INFO's answer on its way to the page (set before it loads): what a server
        or model with those settings says."""

        async def route(ws: WebSocketRoute) -> None:
            upstream = ws.connect_to_server()

            def down(message: str | bytes) -> None:
                kind, _, body = str(message).partition(" ")
                if kind == "MSG" and '"model_info"' in body:
                    payloads = orjson.loads(body)
                    for payload in payloads:
                        if isinstance(payload.get("model_info"), dict):
                            payload["model_info"].update(changes)
                    message = f"{kind} {orjson.dumps(payloads).decode()}"
                ws.send(message)

            upstream.on_message(down)

        await self.page.route_web_socket(re.compile(r"^ws://"), route)

    async def screenshot(self, label: str = "") -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=ARTIFACTS / f"{self.name}{label and '-' + label}.png", full_page=True)

    def stream_id(self, kind: str, index: int = -1) -> int:
        """The stream_id the page gave its `index`-th message of this kind."""
        lines = [line for line in self.sent if line.startswith(kind + " ")]
        return orjson.loads(lines[index].partition(" ")[2])["stream_id"]

    def tokens(self, stream_id: int) -> list[dict]:
        """The TOKEN payloads the server sent for one stream, readouts as numbers (the page asks
        for them as float32 in base64, and checks here that it did)."""
        frames = (payloads for kind, payloads in self.received if kind == "TOKEN")
        out = [dict(p) for payloads in frames for p in payloads if p["stream_id"] == stream_id]
        for payload in out:
            if "readout" in payload:
                assert isinstance(payload["readout"], str), "the page asks for readout_encoding f32"
                payload["readout"] = readout_values(payload["readout"])
        return out

    def model_info(self) -> dict:
        return next(p["model_info"] for kind, ps in self.received if kind == "MSG" for p in ps if "model_info" in p)


@pytest_asyncio.fixture
async def ui(browser: Browser, request: pytest.FixtureRequest) -> AsyncIterator[Ui]:
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(60_000)
    ui = Ui(page, request.node.name)
    page.on("console", lambda message: message.type == "error" and ui.errors.append(message.text))
    page.on("pageerror", lambda error: ui.errors.append(str(error)))

    def on_socket(socket) -> None:
        ui.sockets.append(socket.url)
        socket.on("framesent", lambda data: ui.sent.extend(data.splitlines()))
        socket.on("framereceived", lambda data: ui.received.append(parse_server_line(data)))

    page.on("websocket", on_socket)
    yield ui
    await ui.screenshot()
    await context.close()
