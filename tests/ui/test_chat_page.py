"""The chat view in real Chromium against the default model: the page opens in it, each turn sends
the whole conversation as GENERATE `messages`, the reply streams into its own turn with a heatmap
whose template tokens are marked, steering and monitors apply as in completion, Stop keeps what was
said, an error leaves its exchange out, and Reset empties the conversation."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import orjson
from playwright.async_api import Locator, expect
from transformers import AutoTokenizer

from salience.lmtp.codec import parse_server_line
from tests.ui.conftest import NOT_READ, Ui, probabilities

QUESTION = "What is the capital of France?"


def sent(ui: Ui, kind: str) -> list[dict]:
    """The bodies of the page's messages of this kind, in order."""
    return [orjson.loads(line.partition(" ")[2]) for line in ui.sent if line.startswith(kind + " ")]


async def lmtp_generate(server: str, body: dict) -> list[dict]:
    """One GENERATE over the server's LMTP WebSocket, as any other client sends it: its payloads."""
    payloads = []
    async with aiohttp.ClientSession() as session, session.ws_connect(server) as ws:
        await ws.send_str("GENERATE " + orjson.dumps({"stream_id": 1, **body}).decode())
        async for message in ws:
            payloads += parse_server_line(message.data)[1]
            if payloads[-1].get("finish_reason") or payloads[-1].get("error"):
                return payloads
    raise AssertionError(f"the stream did not end: {payloads[-1:]}")


def reply_text(payloads: list[dict]) -> str:
    """What the assistant said: the reply's pieces without the end-of-turn token that ended it."""
    return "".join(p["text"] for p in payloads if "token" in p and not p.get("prompt") and p["finish_reason"] != "stop")


def template_roles(model: Path, messages: list[dict], prompt_ids: list[int]) -> list[str]:
    """Each prompt token's role by character offsets in transformers' rendered text (not by token
    search, as the page does): the role of the message whose content covers it, else "template"."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    spans, at = [], 0
    for message in messages:
        start = text.index(message["content"], at)
        at = start + len(message["content"])
        spans.append((start, at, message["role"]))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoding["input_ids"] == prompt_ids
    return [next((r for s, e, r in spans if s <= a and b <= e), "template") for a, b in encoding["offset_mapping"]]


async def open_chat(ui: Ui, server: str, **fields: str) -> None:
    await ui.page.goto(server + "ui/")
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    for name, value in fields.items():
        await ui.page.locator(f"#{name}").fill(value)


async def send(ui: Ui, text: str, end: str = "done") -> tuple[Locator, dict, list[dict]]:
    """Type a message and press Enter; the exchange, once its state says `end`, the GENERATE the page
    sent for it and the stream's payloads."""
    await ui.page.locator("#message").fill(text)
    await ui.page.locator("#message").press("Enter")
    exchange = ui.page.locator("#chat .exchange").last
    await expect(exchange.locator(".state")).to_contain_text(end)
    body = sent(ui, "GENERATE")[-1]
    return exchange, body, ui.tokens(body["stream_id"])


async def test_the_page_opens_in_chat_and_the_reply_is_what_lmtp_returns(
    ui: Ui, server: str, default_model: Path
) -> None:
    await open_chat(ui, server, temperature="0")
    await expect(ui.page.get_by_role("tab", name="Chat")).to_have_attribute("aria-selected", "true")
    await expect(ui.page.locator("#request")).to_be_hidden()
    await expect(ui.page.locator("#max_tokens")).to_have_value("256")  # room for a reply
    await ui.page.locator("#max_tokens").fill("40")
    exchange, body, stream = await send(ui, QUESTION)

    messages = [{"role": "user", "content": QUESTION}]
    assert body["messages"] == messages and body["readout"] == [[0, 1_000_000]] and body["temperature"] == 0
    direct = await lmtp_generate(server, {"messages": messages, "temperature": 0, "max_tokens": 40, "text": True})
    said = reply_text(direct)
    assert said.strip() and "<|im_end|>" not in said
    assert direct[-1]["finish_reason"] == "stop", "the model ends its turn"
    await expect(exchange.locator(".message.user .content")).to_have_text(QUESTION)
    assert await exchange.locator(".assistant .stream").text_content() == said == reply_text(stream)
    await expect(exchange.locator(".state")).to_contain_text("done (stop)")

    # A column per position, prompt and reply (the end-of-turn token included), and every cell read.
    (prompt_ids,) = [p["prompt_ids"] for p in stream if "prompt_ids" in p]
    generated = [p for p in stream if "token" in p and not p.get("prompt")]
    heads = exchange.locator(".heatmap thead th")
    await expect(heads).to_have_count(len(prompt_ids) + len(generated))
    await expect(exchange.locator("td.none")).to_have_count(0)
    expected = template_roles(default_model, messages, prompt_ids)
    await expect(heads.nth(len(prompt_ids) - 1)).to_have_attribute("data-role", "template")
    roles = await heads.evaluate_all("ths => ths.map(th => th.dataset.role ?? null)")
    assert roles == expected + [None] * len(generated)
    assert expected[-3:] == ["template"] * 3  # <|im_start|>assistant\n
    assert await exchange.locator("thead th.template").count() == expected.count("template") > 3
    await expect(exchange.locator(".template-key")).to_be_visible()
    # The first turn starts at position 0: not read in the running view, each concept's cell saying why.
    manifest = ui.model_info()["readout_manifest"]
    unread = exchange.locator("td.unread")
    await expect(unread).to_have_count(len(manifest["concepts"]))
    assert await unread.evaluate_all("tds => tds.map(td => Number(td.dataset.position))") == [0] * len(
        manifest["concepts"]
    )
    assert NOT_READ in await unread.first.get_attribute("title")
    assert ui.errors == []


async def test_a_second_turn_sends_the_conversation_and_reset_empties_it(ui: Ui, server: str) -> None:
    system = "You are a geography teacher. Answer in one sentence."
    await open_chat(ui, server, temperature="0", max_tokens="24", system=system)
    _, first, stream = await send(ui, QUESTION)
    assert first["messages"] == [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    said = reply_text(stream)
    (prompt_ids,) = [p["prompt_ids"] for p in stream if "prompt_ids" in p]
    reply_ids = [p["token"] for p in stream if "token" in p and not p.get("prompt")]

    exchange, second, stream = await send(ui, "And the capital of Italy?")
    assert second["messages"] == [
        {"role": "system", "content": system},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": said},
        {"role": "user", "content": "And the capital of Italy?"},
    ]
    # This turn reads from where the first reply ended; on this template that is exactly the
    # first turn's prompt and reply tokens, re-rendered.
    start = len(prompt_ids) + len(reply_ids)
    assert second["readout"] == [[start, 1_000_000]]
    (again,) = [p["prompt_ids"] for p in stream if "prompt_ids" in p]
    assert again[:start] == prompt_ids + reply_ids
    positions = await exchange.locator(".heatmap td[data-row='0']").evaluate_all(
        "tds => tds.map(td => Number(td.dataset.position))"
    )
    assert positions[0] == start and positions == list(range(start, start + len(positions)))
    # Its running view averages this turn's own positions, from `start` (read: it is not position 0).
    readouts = {p["position"]: p["readout"] for p in stream if "readout" in p}
    running, _ = probabilities(ui.model_info()["readout_manifest"], readouts)
    shown = await exchange.locator(".heatmap td[data-value]").evaluate_all(
        "tds => tds.map(td => [Number(td.dataset.position), Number(td.dataset.row), Number(td.dataset.value)])"
    )
    got = {(position, k): value for position, k, value in shown}
    assert min(readouts) == start and got.keys() == running.keys()
    assert all(abs(got[key] - running[key]) < 1e-9 for key in got)
    await expect(exchange.locator("td.unread")).to_have_count(0)
    await expect(ui.page.locator("#chat .exchange")).to_have_count(2)
    await ui.screenshot("two-turns")

    await ui.page.get_by_role("button", name="Reset conversation").click()
    await expect(ui.page.locator("#chat .exchange")).to_have_count(0)
    await expect(ui.page.locator("#system")).to_have_value(system)
    _, third, _ = await send(ui, "Hello!")
    assert third["messages"] == [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]
    assert third["readout"] == [[0, 1_000_000]]
    assert ui.errors == []


async def test_steering_and_monitors_apply_to_the_conversation_in_a_narrow_window(ui: Ui, server: str) -> None:
    await ui.page.set_viewport_size({"width": 360, "height": 800})
    await open_chat(ui, server, temperature="0", max_tokens="24")
    _, plain, stream = await send(ui, "What is your favourite food?")
    assert "steer" not in plain and "monitors" not in plain
    before = reply_text(stream)
    await ui.page.get_by_role("button", name="Reset conversation").click()

    french = ui.page.locator("#steering .steer").filter(has=ui.page.get_by_label("french", exact=True))
    await french.get_by_role("slider").evaluate("(s) => { s.value = '64'; s.dispatchEvent(new Event('input')); }")
    await french.get_by_role("combobox").select_option("15")
    form = ui.page.locator("#monitors")
    concept = ui.model_info()["readout_manifest"]["concepts"][0]
    await form.locator(".concept").select_option(concept)
    await form.locator(".side").select_option("below")
    await form.locator(".threshold").fill("0.999")  # holds on nearly every token: it fires at once
    await form.get_by_role("button", name="add monitor").click()
    exchange, steered, stream = await send(ui, "What is your favourite food?")
    assert steered["steer"] == [{"direction": "french", "layers": [15], "op": "add", "value": 64, "positions": "all"}]
    assert steered["monitors"] == [{"concept": concept, "below": 0.999, "action": "flag"}]
    await expect(exchange.locator(".steered")).to_have_text("steered: french +64 @15")
    assert reply_text(stream) != before
    assert await exchange.locator(".assistant .stream").text_content() == reply_text(stream)

    events = [(p["position"], m) for p in stream for m in p.get("monitors", ())]
    assert events and all(m["concept"] == concept and m["action"] == "flag" for _, m in events)
    await expect(exchange.locator(".monitor-events li")).to_have_count(len(events))
    marked = await exchange.locator("thead th.monitor").evaluate_all("ths => ths.map(th => th.title)")
    assert len(marked) == len({position for position, _ in events})
    assert all("monitor 0 flag" in title for title in marked)
    overflow = await ui.page.evaluate("document.documentElement.scrollWidth - innerWidth")
    assert overflow <= 0, "the page scrolls sideways in a narrow window"
    await ui.screenshot("steered")
    assert ui.errors == []


async def test_stop_keeps_what_was_said_and_an_error_leaves_its_exchange_out(ui: Ui, server: str) -> None:
    await open_chat(ui, server, temperature="0", max_tokens="1500")
    await ui.page.locator("#readouts").set_checked(False)
    count = "Count from 1 to 500, one number per line."
    await ui.page.locator("#message").fill(count)
    await ui.page.locator("#message").press("Enter")
    stopped = ui.page.locator("#chat .exchange").last
    await expect(stopped.locator(".tok").nth(4)).to_be_attached()
    await expect(ui.page.get_by_role("button", name="Send")).to_be_disabled()  # one reply at a time
    await stopped.get_by_role("button", name="Stop").click()
    await expect(stopped.locator(".state")).to_contain_text("stopped")
    stream_id = sent(ui, "GENERATE")[-1]["stream_id"]
    assert f'CANCEL {{"stream_id":{stream_id}}}' in ui.sent
    assert ui.tokens(stream_id)[-1]["finish_reason"] == "cancelled"
    kept = reply_text(ui.tokens(stream_id))
    assert kept and await stopped.locator(".stream").text_content() == kept

    await ui.page.locator("#temperature").fill("-1")
    failed, _, stream = await send(ui, "Hi", end="error")
    (payload,) = [p for p in stream if "error" in p]
    await expect(failed.locator(".error")).to_have_text(payload["error"])
    await expect(failed).to_have_class(re.compile(r"\bdropped\b"))
    await expect(ui.page.locator("#message")).to_have_value("Hi")  # to ask again

    await ui.page.locator("#temperature").fill("0")
    await ui.page.locator("#max_tokens").fill("4")
    _, body, _ = await send(ui, "Hi")
    assert body["messages"] == [
        {"role": "user", "content": count},
        {"role": "assistant", "content": kept},
        {"role": "user", "content": "Hi"},
    ]
    assert ui.errors == []


async def test_template_tokens_are_those_no_message_holds_found_in_order(ui: Ui, server: str) -> None:
    """The page's rule (js/turn.js `roles`) on ids made up to hit its edges."""
    await open_chat(ui, server)
    roles = "(args) => import('./js/turn.js').then((turn) => turn.roles(...args))"
    user, assistant = {"role": "user"}, {"role": "assistant"}
    # The same content twice: the second is looked for after the first; empty content holds nothing.
    got = await ui.page.evaluate(roles, [[1, 7, 2, 1, 7, 2, 1], [user, user, assistant], [[7], [], [7]]])
    assert got == ["template", "user", "template", "template", "assistant", "template", "template"]
    # A message whose tokens are not there: nothing is marked rather than its words as template.
    assert await ui.page.evaluate(roles, [[1, 7, 2], [user, assistant], [[7], [8]]]) is None
    assert await ui.page.evaluate(roles, [[1, 7, 2], [user, assistant], [[7], [7]]]) is None
    assert ui.errors == []


async def test_a_model_without_a_template_opens_in_completion(ui: Ui, server: str) -> None:
    """MODEL_INFO's chat_template set to false on the way to the page: what a model without one says."""

    await ui.rewrite_model_info(chat_template=False)
    await open_chat(ui, server)
    await expect(ui.page.get_by_role("tab", name="Completion")).to_have_attribute("aria-selected", "true")
    await expect(ui.page.get_by_role("tab", name="Chat")).to_be_disabled()
    await expect(ui.page.get_by_role("button", name="Generate")).to_be_visible()
    await expect(ui.page.locator("#max_tokens")).to_have_value("48")
    assert ui.errors == []


async def test_the_tabs_switch_views_keep_max_tokens_each_and_name_the_view(ui: Ui, server: str) -> None:
    await ui.page.goto(server + "ui/#completion")
    await expect(ui.page.locator("#connection")).to_have_text("ready")
    await expect(ui.page.get_by_role("tab", name="Completion")).to_have_attribute("aria-selected", "true")
    await ui.page.locator("#max_tokens").fill("7")
    await ui.page.get_by_role("tab", name="Completion").focus()
    await ui.page.keyboard.press("ArrowLeft")
    await expect(ui.page.get_by_role("tab", name="Chat")).to_be_focused()
    await expect(ui.page.locator("#message")).to_be_visible()
    await expect(ui.page.locator("#prompt")).to_be_hidden()
    await expect(ui.page.locator("#max_tokens")).to_have_value("256")
    assert ui.page.url.endswith("/ui/#chat")
    await ui.page.get_by_role("tab", name="Completion").click()
    await expect(ui.page.locator("#max_tokens")).to_have_value("7")
    assert ui.errors == []
