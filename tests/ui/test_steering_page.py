"""The page's steering controls in real Chromium against the default model: a slider and a layer per
concept, sent as GENERATE's `steer`, and the readouts and text change as docs/steering.md says."""

from __future__ import annotations

import orjson
from playwright.async_api import expect

from tests.ui.conftest import COMPLETION, Ui


async def generate(ui: Ui) -> tuple[list[dict], dict]:
    """Click Generate in a ready page; the stream's payloads and the GENERATE the page sent."""
    await ui.page.get_by_role("button", name="Generate").click()
    await expect(ui.page.locator(".pane").first.locator(".state")).to_contain_text("done")
    sent = orjson.loads(next(line for line in reversed(ui.sent) if line.startswith("GENERATE ")).partition(" ")[2])
    return ui.tokens(sent["stream_id"]), sent


async def test_a_slider_steers_the_generation_and_its_readouts(ui: Ui, server: str) -> None:
    await ui.page.goto(server + COMPLETION)
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    info = ui.model_info()
    directions = info["steering"]["directions"]
    rows = ui.page.locator("#steering .steer")
    await expect(rows).to_have_count(len(directions))
    assert await rows.evaluate_all("rs => rs.map(r => r.dataset.direction)") == list(directions)
    await ui.page.locator("#prompt").fill("My favourite food is")
    await ui.page.locator("#temperature").fill("0")
    await ui.page.locator("#max_tokens").fill("12")

    plain, sent = await generate(ui)
    assert "steer" not in sent

    french = rows.filter(has=ui.page.get_by_label("french", exact=True))
    # A range input cannot be typed into: set it as a drag would, with an input event.
    await french.get_by_role("slider").evaluate("(s) => { s.value = '64'; s.dispatchEvent(new Event('input')); }")
    await expect(french.locator("output")).to_have_text("64")
    await french.get_by_role("combobox").select_option("15")
    steered, sent = await generate(ui)
    assert sent["steer"] == [{"direction": "french", "layers": [15], "op": "add", "value": 64, "positions": "all"}]
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".steered")).to_have_text("steered: french +64 @15")
    await ui.screenshot("steered")

    # The text changes, and at layer 15 the french readout of every prompt position is 64 higher.
    text = "".join(p["text"] for p in steered if "text" in p)
    assert text != "".join(p["text"] for p in plain if "text" in p)
    concepts, layers = info["readout_manifest"]["concepts"], info["readout_manifest"]["layers"]
    at = layers.index(15) * len(concepts) + concepts.index("french")
    before = {p["position"]: p["readout"][at] for p in plain if p.get("prompt")}
    after = {p["position"]: p["readout"][at] for p in steered if p.get("prompt")}
    assert sorted(after) == sorted(before)
    for position in before:
        assert abs(after[position] - before[position] - 64) < 1e-2 * max(1.0, abs(before[position]))

    await ui.page.get_by_role("button", name="reset").click()
    await expect(french.locator("output")).to_have_text("0")
    _, sent = await generate(ui)
    assert "steer" not in sent
    assert ui.errors == []
