"""Live concepts from the page in real Chromium against the default model: the "Define a concept"
form sends DEFINE_CONCEPT and shows the held-out table; the concept then joins the monitors, the
steering rows and the heatmap of the next request (its few-examples warning shown beside it), until
its delete button takes it out again."""

from __future__ import annotations

import re

import orjson
from playwright.async_api import Locator, expect

from tests.ui.conftest import COMPLETION, Ui

NAME = "formal"
POSITIVE = [
    "Dear Sir or Madam, I am writing to enquire about the advertised position.",
    "We kindly request that you submit the signed documents by Friday.",
    "Please accept my sincere apologies for any inconvenience caused.",
    "The committee shall convene at ten o'clock on Monday morning.",
]
NEGATIVE = [
    "hey whats up, wanna grab some food later?",
    "lol that was so dumb haha",
    "gonna crash at my place tonight, cool?",
    "nah dude no way, thats wild",
]
FIT_TIMEOUT = 180_000  # ms: the fit reads every example through the model on two shared cores


def sent(ui: Ui, kind: str) -> list[dict]:
    """The bodies of the page's messages of this kind, in order."""
    return [orjson.loads(line.partition(" ")[2]) for line in ui.sent if line.startswith(kind + " ")]


def reply(ui: Ui, stream_id: int) -> dict:
    """The MSG payload answering the page's request `stream_id`."""
    return next(p for kind, ps in ui.received if kind == "MSG" for p in ps if p.get("stream_id") == stream_id)


async def open_form(ui: Ui, url: str) -> Locator:
    await ui.page.goto(url)
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    section = ui.page.locator("#concepts")
    await section.locator("summary").click()
    return section


async def fill(section: Locator, name: str, positive: str, negative: str) -> None:
    await section.get_by_label("name", exact=True).fill(name)
    await section.get_by_label("positive examples, one per line").fill(positive)
    await section.get_by_label("negative examples, one per line").fill(negative)


async def test_a_defined_concept_joins_monitors_steering_and_the_heatmap_until_deleted(ui: Ui, server: str) -> None:
    section = await open_form(ui, server + COMPLETION)
    await fill(section, NAME, "\n".join(POSITIVE), "\n".join(NEGATIVE))
    await section.get_by_role("button", name="Define", exact=True).click()
    table = section.locator("pre.table")
    await expect(table).to_contain_text("layer  auroc", timeout=FIT_TIMEOUT)

    (define,) = sent(ui, "DEFINE_CONCEPT")
    assert define == {"name": NAME, "positive": POSITIVE, "negative": NEGATIVE, "stream_id": define["stream_id"]}
    defined = reply(ui, define["stream_id"])
    assert await table.text_content() == defined["table"]
    status = section.locator(".status")
    await expect(status).to_have_text(f"defined {NAME} (concepts version {defined['version']})")
    await expect(section.get_by_role("button", name="Define", exact=True)).to_be_enabled()

    # The page read MODEL_INFO again and rebuilt what lists the concepts.
    monitor_option = ui.page.locator(f'#monitors .concept option[value="{NAME}"]')
    steer_row = ui.page.locator(f'#steering .steer[data-direction="{NAME}"]')
    await expect(monitor_option).to_have_count(1)
    await expect(steer_row).to_have_count(1)
    await expect(section.locator(".live li")).to_have_count(1)
    await expect(section.locator(".live li")).to_contain_text(NAME)
    info = reply(ui, sent(ui, "MODEL_INFO")[-1]["stream_id"])["model_info"]
    manifest = info["readout_manifest"]
    assert manifest["version"] == defined["version"] and manifest["live"] == [NAME]
    rows = ui.page.locator("#steering .steer")
    assert await rows.evaluate_all("rs => rs.map(r => r.dataset.direction)") == list(info["steering"]["directions"])

    # A new pane reads with the new manifest: a heatmap row for the concept, with the server's numbers.
    await ui.page.locator("#prompt").fill("Dear Sir, I write to inform you of the decision.")
    await ui.page.get_by_role("button", name="Score prompt").click()
    pane = ui.page.locator(".pane").first
    await expect(pane.locator(".state")).to_contain_text("done")
    await expect(pane.locator("td.none")).to_have_count(0)
    concepts, layers = manifest["concepts"], manifest["layers"]
    assert concepts[-1] == NAME
    heatmap_rows = pane.locator(".heatmap tbody th button")
    assert await heatmap_rows.all_text_contents() == concepts
    readouts = {p["position"]: p["readout"] for p in ui.tokens(ui.stream_id("SCORE")) if "readout" in p}
    assert readouts and all(len(readout) == len(layers) * len(concepts) for readout in readouts.values())
    await pane.locator("select.view").select_option("raw")
    last, k = len(layers) - 1, len(concepts) - 1
    await pane.locator("select.layer").select_option(str(last))
    shown = await pane.locator(f'td[data-row="{k}"][data-value]').evaluate_all(
        "tds => tds.map(td => [Number(td.dataset.position), td.dataset.value])"
    )
    assert {position: float(value) for position, value in shown} == {
        position: readout[last * len(concepts) + k] for position, readout in readouts.items()
    }
    # Four examples a class: the builder's warning is in the concept's tooltip, marked beside its name,
    # and under the monitor controls when it is chosen.
    warning = f"warning: {manifest['concept_info'][-1]['warning']}"
    assert warning.startswith("warning: few examples")
    assert warning in await pane.get_by_role("button", name=NAME, exact=True).get_attribute("title")
    await expect(pane.locator(".heatmap tbody tr").last.locator(".warning")).to_have_attribute("title", warning)
    await expect(pane.locator(".heatmap .warning")).to_have_count(1)
    await ui.page.locator("#monitors .concept").select_option(NAME)
    await expect(ui.page.locator("#monitors .facts")).to_contain_text(warning)
    await ui.screenshot("defined")

    await section.get_by_role("button", name=f"delete {NAME}").click()
    await expect(status).to_have_text(re.compile(f"^deleted {NAME} "))
    await expect(monitor_option).to_have_count(0)
    await expect(steer_row).to_have_count(0)
    await expect(section.locator(".live li")).to_have_count(0)
    (delete,) = sent(ui, "DELETE_CONCEPT")
    assert delete == {"name": NAME, "stream_id": delete["stream_id"]}
    assert reply(ui, delete["stream_id"])["deleted"] is True
    assert reply(ui, sent(ui, "MODEL_INFO")[-1]["stream_id"])["model_info"]["readout_manifest"]["live"] == []
    assert await heatmap_rows.all_text_contents() == concepts, "a pane keeps the manifest it started with"
    assert ui.errors == []


async def test_too_few_examples_or_no_name_are_refused_in_the_page_and_nothing_is_sent(ui: Ui, server: str) -> None:
    section = await open_form(ui, server + COMPLETION)
    status = section.locator(".status")
    define = section.get_by_role("button", name="Define", exact=True)
    # A blank line is no example: three positive ones.
    await fill(section, NAME, f"{POSITIVE[0]}\n\n{POSITIVE[1]}\n{POSITIVE[2]}\n", "\n".join(NEGATIVE))
    await define.click()
    await expect(status).to_have_text("3 positive examples: give 4 to 256, one per line")
    await expect(status).to_have_class(re.compile(r"\bbad\b"))
    await fill(section, "  ", "\n".join(POSITIVE), "\n".join(NEGATIVE))
    await define.click()
    await expect(status).to_have_text("give the concept a name")
    await expect(section.locator("pre.table")).to_be_hidden()
    assert sent(ui, "DEFINE_CONCEPT") == []
    assert ui.errors == []
