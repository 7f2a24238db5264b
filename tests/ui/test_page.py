"""The browser page end to end: real Chromium, a real server on the default model.

Values on the page are checked against the LMTP frames the page itself received, so
"the heatmap shows the server's numbers" means equal floats, not a look-alike.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from playwright.async_api import Locator, expect

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.serving.status import ServerStatus
from salience.http_app import make_app
from salience.lmtp.session import LmtpConfig
from tests.conftest import free_port
from tests.ui.conftest import COMPLETION, NOT_READ, Ui, probabilities, serve

# Chromium reports a refused WebSocket as a console error; only the reconnect test expects it.
REFUSED = "net::ERR_CONNECTION_REFUSED"


async def open_page(ui: Ui, url: str, **fields: str) -> None:
    await ui.page.goto(url)
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    for name, value in fields.items():
        await ui.page.locator(f"#{name}").fill(value)


async def set_readouts(ui: Ui, on: bool) -> None:
    await ui.page.locator("#readouts").set_checked(on)


async def test_a_generation_streams_into_token_cells(ui: Ui, server: str) -> None:
    await ui.page.goto(server)  # a plain GET of / redirects to the page
    assert ui.page.url == server + "ui/"
    await open_page(ui, server + COMPLETION, prompt="The capital of France is", temperature="0", max_tokens="12")
    await set_readouts(ui, False)
    await ui.page.get_by_role("button", name="Generate").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")

    payloads = [p for p in ui.tokens(ui.stream_id("GENERATE")) if "token" in p]
    cells = pane.locator(".tok")
    assert await cells.count() == len(payloads) > 1
    assert await cells.all_text_contents() == [p["text"] for p in payloads]
    assert [float(x) for x in await cells.evaluate_all("cs => cs.map(c => c.dataset.logprob)")] == [
        p["logprob"] for p in payloads
    ]
    frames = [ps for kind, ps in ui.received if kind == "TOKEN" and any("token" in p for p in ps)]
    assert len(frames) > 1, "tokens arrive as they are generated, not in one frame"

    # Focus (keyboard) shows the alternatives with their probabilities, best first.
    await cells.first.focus()
    tip = ui.page.locator("#tip")
    await expect(tip.locator("tbody tr")).to_have_count(len(payloads[0]["top_logprobs"]))
    best = max(payloads[0]["top_logprobs"].values())
    assert f"{100 * math.exp(best):.1f}%" in await tip.locator("tbody tr").first.inner_text()
    await ui.page.keyboard.press("ArrowRight")
    await expect(cells.nth(1)).to_be_focused()
    assert ui.errors == []


async def test_heatmap_shows_the_servers_readouts_for_prompt_and_generated_tokens(ui: Ui, server: str) -> None:
    await open_page(ui, server + COMPLETION, prompt="I love this wonderful film", temperature="0", max_tokens="6")
    await ui.page.get_by_role("button", name="Generate").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")
    await expect(pane.locator("td.none")).to_have_count(0)  # the last token's readout included

    stream = ui.tokens(ui.stream_id("GENERATE"))
    readouts = {p["position"]: p["readout"] for p in stream if "readout" in p}
    prompt = sum(1 for p in stream if p.get("prompt"))
    generated = sum(1 for p in stream if "token" in p and not p.get("prompt"))
    assert sorted(readouts) == list(range(prompt + generated))
    manifest = ui.model_info()["readout_manifest"]
    concepts, layers = manifest["concepts"], manifest["layers"]

    await pane.locator("select.view").select_option("raw")
    for layer_index in (len(layers) - 1, 0):
        await pane.locator("select.layer").select_option(str(layer_index))
        shown = await pane.locator("td[data-value]").evaluate_all(
            "tds => tds.map(td => [Number(td.dataset.position), Number(td.dataset.row), td.dataset.value])"
        )
        expected = {
            (position, k): readout[layer_index * len(concepts) + k]
            for position, readout in readouts.items()
            for k in range(len(concepts))
        }
        assert {(position, k): float(value) for position, k, value in shown} == expected

    await pane.get_by_role("button", name=concepts[0]).click()
    line = pane.locator(".concept-line")
    await expect(line).to_be_visible()
    points = await line.locator("polyline").get_attribute("points")
    assert len(points.split()) == len(readouts)
    await expect(pane.locator(".legend .ramp")).to_be_visible()
    assert ui.errors == []


async def test_stop_cancels_a_running_generation(ui: Ui, server: str) -> None:
    await open_page(ui, server + COMPLETION, prompt="1, 2, 3, 4, 5, 6, 7,", temperature="0", max_tokens="1500")
    await set_readouts(ui, False)
    await ui.page.locator("#prompt").press("Control+Enter")  # keyboard only
    pane = ui.page.locator(".pane").first
    cells = pane.locator(".tok")
    await expect(cells.nth(4)).to_be_attached()
    await pane.get_by_role("button", name="Stop").focus()
    await ui.page.keyboard.press("Enter")
    await expect(pane.locator(".state")).to_contain_text("stopped")

    stopped_at = await cells.count()
    await asyncio.sleep(1)
    assert await cells.count() == stopped_at < 1500
    stream_id = ui.stream_id("GENERATE")
    assert ui.sent[-1] == f'CANCEL {{"stream_id":{stream_id}}}'
    assert ui.tokens(stream_id)[-1]["finish_reason"] == "cancelled"
    assert ui.errors == []


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("top_k", "-5", "top_k must be >= -1"), ("temperature", "-1", "temperature")],
)
async def test_a_bad_parameter_shows_the_servers_error_in_its_pane(
    ui: Ui, server: str, field: str, value: str, words: str
) -> None:
    await open_page(ui, server + COMPLETION, **{field: value})
    await ui.page.get_by_role("button", name="Generate").click()
    error = ui.page.locator(".pane").first.locator(".error")
    await expect(error).to_be_visible()
    (payload,) = ui.tokens(ui.stream_id("GENERATE"))
    assert words in payload["error"]
    assert await error.inner_text() == payload["error"]
    assert ui.errors == []


async def test_score_mode_reads_the_prompt_in_a_narrow_window(ui: Ui, server: str) -> None:
    await ui.page.set_viewport_size({"width": 360, "height": 800})
    await open_page(ui, server + COMPLETION, prompt="Bonjour, je suis")
    await ui.page.get_by_role("button", name="Score prompt").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")
    await expect(pane.locator("td.none")).to_have_count(0)

    payloads = ui.tokens(ui.stream_id("SCORE"))
    scored = [p for p in payloads if not p.get("prompt")]
    logprobs = await pane.locator(".tok").evaluate_all("cs => cs.map(c => c.dataset.logprob ?? null)")
    assert logprobs[0] is None and [float(x) for x in logprobs[1:]] == [p["logprob"] for p in scored]
    assert await pane.locator("thead th").count() == len(scored) + 1
    overflow = await ui.page.evaluate("document.documentElement.scrollWidth - innerWidth")
    assert overflow <= 0, "the page scrolls sideways in a narrow window"
    assert ui.errors == []


async def test_connection_state_loading_ready_draining_stopping_lost_and_back(ui: Ui, engine: Engine) -> None:
    port = free_port()
    status = ServerStatus(engine.model_name)
    runner = await serve(make_app(status, LmtpConfig()), port)
    state = ui.page.locator("#connection")
    try:
        await ui.page.goto(f"http://127.0.0.1:{port}/{COMPLETION}")
        await expect(state).to_have_text("loading model…")
        await ui.screenshot("loading")
        await expect(ui.page.get_by_role("button", name="Generate")).to_be_disabled()
        status.ready(engine)
        await expect(state).to_have_text("ready")
        status.draining()  # SIGTERM: running requests finish, new ones are refused
        await expect(state).to_have_text("server draining: finishing running requests")
        await expect(ui.page.get_by_role("button", name="Generate")).to_be_disabled()
        await ui.screenshot("draining")
        status.stopping()
        await expect(state).to_have_text("server shutting down")
        await runner.cleanup()
        await expect(state).to_contain_text("connection lost — reconnecting")
        status = ServerStatus(engine.model_name)
        status.ready(engine)
        runner = await serve(make_app(status, LmtpConfig()), port)
        await expect(state).to_have_text("ready", timeout=15_000)
    finally:
        await runner.cleanup()
    assert len(ui.sockets) >= 2
    assert [e for e in ui.errors if REFUSED not in e] == []


async def test_a_wrong_token_shows_unauthorized_and_the_right_one_connects(ui: Ui, engine: Engine) -> None:
    status = ServerStatus(engine.model_name)
    status.ready(engine)
    port = free_port()
    runner = await serve(make_app(status, LmtpConfig(tokens=Tokens("s3cret"))), port)
    state = ui.page.locator("#connection")
    try:
        await ui.page.goto(f"http://127.0.0.1:{port}/ui/")
        await expect(state).to_contain_text("unauthorized")
        await ui.screenshot("unauthorized")
        await asyncio.sleep(1.5)
        assert len(ui.sockets) == 1, "no reconnect loop on 4401"
        await expect(ui.page.locator("#auth")).to_have_attribute("open", "")  # the page opens the field
        await ui.page.locator("#token").fill("s3cret")
        await ui.page.locator("#token").press("Enter")
        await expect(state).to_have_text("ready")
        assert ui.sockets[-1].endswith("/?token=s3cret")
        assert await ui.page.evaluate("sessionStorage.getItem('salience-token')") == "s3cret"
    finally:
        await runner.cleanup()
    assert ui.errors == []


async def shown_values(pane: Locator) -> dict[tuple[int, int], float]:
    shown = await pane.locator("td[data-value]").evaluate_all(
        "tds => tds.map(td => [Number(td.dataset.position), Number(td.dataset.row), Number(td.dataset.value)])"
    )
    return {(position, k): value for position, k, value in shown}


async def test_heatmap_shows_probabilities_with_their_legend_writes_and_monitor_marks(ui: Ui, server: str) -> None:
    """By default the running view, each concept at its recommended layer, p through the manifest's
    published running map of the mean raw value so far; the token view through the token map;
    position 0 unread (grey, saying why) in both, its number in raw. A flag monitor added in the form
    marks the columns where the token p starts to hold."""
    await open_page(
        ui, server + COMPLETION, prompt="def add(a, b):\n    return a + b\n\n", temperature="0", max_tokens="8"
    )
    manifest = ui.model_info()["readout_manifest"]
    concepts, info = manifest["concepts"], manifest["concept_info"]
    form = ui.page.locator("#monitors")
    await form.locator(".concept").select_option("code")
    code_info = info[concepts.index("code")]
    best = next(f for f in code_info["layers"] if f["layer"] == code_info["recommended_layer"])
    facts = await form.locator(".facts").inner_text()
    low, high = best["auroc_interval"]
    assert f"AUROC {best['auroc']:.3f} (95% interval {low:.3f}–{high:.3f})" in facts
    assert f"background false positives {100 * best['background_fpr']:.1f}%" in facts
    await form.locator(".threshold").fill("0.01")  # code after code: it holds from the first token
    await form.get_by_role("button", name="add monitor").click()
    await ui.page.get_by_role("button", name="Generate").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")
    await expect(pane.locator("td.none")).to_have_count(0)

    stream = ui.tokens(ui.stream_id("GENERATE"))
    readouts = {p["position"]: p["readout"] for p in stream if "readout" in p}
    assert 0 in readouts and len(readouts) > 2
    running, token = probabilities(manifest, readouts)
    view = pane.locator("select.view")
    assert await view.input_value() == "running"
    legend = pane.locator(".legend")
    await expect(legend.locator(".what")).to_contain_text("running: p that the text so far has the concept")
    assert await legend.locator(".lo").inner_text() == "p = 0"
    got = await shown_values(pane)
    assert got.keys() == running.keys()
    assert all(abs(got[key] - running[key]) < 1e-9 for key in got)

    async def position_0_unread() -> None:
        first = pane.locator('td[data-position="0"]')
        await expect(first).to_have_count(len(concepts))
        assert await first.evaluate_all(
            "tds => tds.map(td => [td.classList.contains('unread'), td.dataset.value ?? null,"
            " getComputedStyle(td).backgroundColor])"
        ) == [[True, None, "rgb(190, 190, 190)"]] * len(concepts)
        assert all(NOT_READ in title for title in await first.evaluate_all("tds => tds.map(td => td.title)"))
        await first.first.hover()
        await expect(pane.locator(".cell-info")).to_contain_text(NOT_READ)
        await expect(pane.locator(".unread-key")).to_be_visible()

    await position_0_unread()
    await view.select_option("token")
    await expect(legend.locator(".what")).to_contain_text("token: p that this token belongs to a text with the concept")
    got = await shown_values(pane)
    assert got.keys() == token.keys()
    assert all(abs(got[key] - token[key]) < 1e-12 for key in got)
    await position_0_unread()
    await view.select_option("raw")
    await expect(legend.locator(".what")).to_contain_text("raw: ")
    await expect(pane.locator("td.unread")).to_have_count(0)
    await expect(pane.locator(".unread-key")).to_be_hidden()
    first = await pane.locator('td[data-position="0"]').evaluate_all("tds => tds.map(td => Number(td.dataset.value))")
    layers = manifest["layers"]
    assert first == [readouts[0][layers.index(c["recommended_layer"]) * len(concepts) + k] for k, c in enumerate(info)]
    await view.select_option("running")

    title = await pane.get_by_role("button", name="code").get_attribute("title")
    assert "raises:" in title and "lowers:" in title
    assert f"held out at layer {code_info['recommended_layer']} (the recommended layer)" in title
    assert f"(95% interval {low:.3f}–{high:.3f})" in title
    low_fpr, high_fpr = best["background_fpr_interval"]
    assert f"(95% interval {100 * low_fpr:.1f}%–{100 * high_fpr:.1f}%)" in title
    assert "warning" not in title and await pane.locator(".heatmap .warning").count() == 0  # 60+ examples a class

    events = [(p["position"], m) for p in stream for m in p.get("monitors", ())]
    assert events and all(m["concept"] == "code" and m["action"] == "flag" for _, m in events)
    code = concepts.index("code")
    generated = sorted(p["position"] for p in stream if "token" in p and not p.get("prompt"))
    holds = [token[(position, code)] > 0.01 for position in generated]  # monitors watch the token view
    starts = [g for n, g in enumerate(generated) if holds[n] and (n == 0 or not holds[n - 1])]
    assert [position for position, _ in events] == starts
    marked = await pane.locator("thead th.monitor").count()
    assert marked == len({position for position, _ in events})
    await expect(pane.locator(".monitor-events li")).to_have_count(len(events))
    assert ui.errors == []
