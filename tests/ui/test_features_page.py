"""SAE features on the page in real Chromium against the default model with a random topk SAE:
each Generate and Score asks for the first SAE's top features over every position, the prompt
shows as token cells, and every token's tooltip lists the features the server sent for it; with
no SAE in MODEL_INFO the page asks for nothing and shows the prompt as plain text, as before."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
import pytest_asyncio
import torch
from playwright.async_api import Locator, expect

from salience.core.engine.engine import Engine
from salience.core.features.sae import load_sae, save_sae
from salience.core.probes.concepts import ConceptSet
from tests.conftest import start_engine
from tests.ui.conftest import COMPLETION, Ui

NAME, LAYER, D_SAE, K = "rand", 12, 1024, 16
HIDDEN = 576  # SmolLM2-135M's


@pytest_asyncio.fixture(scope="module")
async def engine(
    default_model: Path, concepts: ConceptSet, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Engine]:
    """conftest's engine plus a random topk SAE (the server fixture serves it)."""
    generator = torch.Generator().manual_seed(7)
    w_dec = torch.randn(D_SAE, HIDDEN, generator=generator)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    folder = tmp_path_factory.mktemp("sae") / NAME
    save_sae(
        folder,
        architecture="topk",
        layer=LAYER,
        W_enc=w_dec.T.contiguous(),
        b_enc=torch.zeros(D_SAE),
        W_dec=w_dec,
        b_dec=torch.zeros(HIDDEN),
        k=K,
        model_name="SmolLM2-135M-Instruct",
    )
    engine = await start_engine(
        default_model, max_model_len=2048, concepts=concepts, saes=(load_sae(folder, name=NAME),)
    )
    yield engine
    engine.shutdown()


def sent(ui: Ui, kind: str) -> list[dict]:
    return [orjson.loads(line.partition(" ")[2]) for line in ui.sent if line.startswith(kind + " ")]


async def tooltip_features(ui: Ui, cell: Locator) -> list[list]:
    """Hover the cell; the features its tooltip lists, as [id, activation], after checking their text."""
    await cell.hover()
    tip = ui.page.locator("#tip")
    await expect(tip.locator(".features-heading")).to_have_text(re.compile(f"^features of SAE {NAME} at layer {LAYER}"))
    rows = tip.locator("table.features tr")
    shown = await rows.evaluate_all("trs => trs.map(tr => [Number(tr.dataset.feature), tr.dataset.activation])")
    texts = await rows.all_inner_texts()
    assert [re.sub(r"\s+", " ", t.strip()) for t in texts] == [f"#{i} {float(a):.2f}" for i, a in shown]
    await ui.page.mouse.move(0, 0)
    await expect(tip).to_be_hidden()
    return [[i, float(a)] for i, a in shown]


async def test_every_tokens_tooltip_lists_its_sae_features(ui: Ui, server: str) -> None:
    await ui.page.goto(server + COMPLETION)
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    await expect(ui.page.locator("#model")).to_contain_text(f"features: SAE {NAME}, layer {LAYER}")
    (sae,) = ui.model_info()["saes"]
    assert (sae["name"], sae["layer"], sae["top"]) == (NAME, LAYER, K)
    await ui.page.locator("#prompt").fill("The capital of France is")
    await ui.page.locator("#temperature").fill("0")
    await ui.page.locator("#max_tokens").fill("5")
    await ui.page.locator("#readouts").set_checked(False)
    await ui.page.get_by_role("button", name="Generate").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")

    (generate,) = sent(ui, "GENERATE")
    prompt = generate["prompt"]
    assert generate["features"] == {"sae": NAME, "k": 8, "ranges": [[0, len(prompt) + 5]]}
    stream = ui.tokens(generate["stream_id"])
    n = len(prompt) + sum(1 for p in stream if "token" in p and not p.get("prompt"))
    features = {p["position"]: p["features"] for p in stream if "features" in p}
    assert sorted(features) == list(range(n)) and n > len(prompt)
    assert all(0 < len(f) <= 8 for f in features.values())  # a topk SAE on random directions: always some
    cells = pane.locator(".tok")
    await expect(cells).to_have_count(n)
    await expect(pane.locator(".tok[data-prompt]")).to_have_count(len(prompt))
    await expect(pane.locator(".state")).to_contain_text(f"· {n - len(prompt)} token")  # prompt cells not counted
    for position in (1, len(prompt) - 1, len(prompt), n - 1):
        assert await tooltip_features(ui, cells.nth(position)) == features[position]
    # A generated token's tooltip still lists its alternatives, above the features.
    await cells.nth(len(prompt)).hover()
    await expect(ui.page.locator("#tip thead")).to_have_count(1)
    assert await ui.page.locator("#tip > *").evaluate_all("es => es.map(e => e.tagName)") == [
        "P",
        "TABLE",
        "P",
        "TABLE",
    ]

    await ui.screenshot("tooltip")

    # Score mode: the first token's features come in its prompt payload, after its cell.
    await ui.page.get_by_role("button", name="Score prompt").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")
    (score,) = sent(ui, "SCORE")
    assert score["features"] == {"sae": NAME, "k": 8, "ranges": [[0, len(prompt)]]}
    scored = {p["position"]: p["features"] for p in ui.tokens(score["stream_id"]) if "features" in p}
    assert sorted(scored) == list(range(len(prompt)))
    cells = pane.locator(".tok")
    for position in (0, len(prompt) - 1):
        assert await tooltip_features(ui, cells.nth(position)) == scored[position]
    assert ui.errors == []


async def test_without_an_sae_the_page_asks_for_no_features(ui: Ui, server: str) -> None:
    """MODEL_INFO with its saes emptied on the way to the page: what a server without --sae says."""

    await ui.rewrite_model_info(saes=[])
    await ui.page.goto(server + COMPLETION)
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    await expect(ui.page.locator("#model")).not_to_contain_text("features")
    await ui.page.locator("#max_tokens").fill("3")
    await ui.page.locator("#readouts").set_checked(False)
    await ui.page.get_by_role("button", name="Generate").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")
    body = pane.locator(".protocol pre")
    (line,) = [x for x in (await body.text_content()).splitlines() if x.startswith("GENERATE ")]
    assert "features" not in orjson.loads(line.partition(" ")[2])
    await expect(pane.locator(".stream .context")).to_have_count(1)
    await expect(pane.locator(".tok[data-prompt]")).to_have_count(0)
    await pane.locator(".tok").first.hover()
    await expect(ui.page.locator("#tip tbody tr").first).to_be_visible()
    await expect(ui.page.locator("#tip .features-heading")).to_have_count(0)
    assert ui.errors == []
