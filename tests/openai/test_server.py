"""The OpenAI API on a real engine, driven by the official `openai` client (sync, async and
streaming) and LangChain's ChatOpenAI: chat rendered as transformers renders it, logprobs equal
to transformers', readouts equal to what the core gives LMTP, monitors and steering taking
effect, every bad input as the documented exception, and an abandoned stream aborted in vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.probes.calibration import ReadoutView
from salience.lmtp.session import LmtpConfig
from salience.openai.tokens import token_text
from tests.inprocess import Frontends, frontends
from tests.reference import Reference

NAME = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2 + 2?"}]
TOKEN = "openai-test-token"
PNG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}  # on a text model
HTTP_IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


@pytest.fixture(scope="module")
def reference(default_model: Path) -> Reference:
    return Reference(default_model)


@pytest.fixture(scope="module")
def prompt(default_model: Path) -> list[int]:
    """QUESTION as transformers renders it, with the generation prompt."""
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    return list(tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False))


def client(served: Frontends, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key=api_key, max_retries=0)


async def test_models_lists_the_served_name(served: Frontends) -> None:
    models = await asyncio.to_thread(lambda: client(served).models.list())
    assert NAME in [m.id for m in models.data]


async def test_a_greedy_chat_is_transformers_reply_with_its_logprobs(
    served: Frontends, default_engine: Engine, reference: Reference, prompt: list[int]
) -> None:
    reply = await asyncio.to_thread(
        lambda: client(served).chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
        )
    )
    assert reply.usage.prompt_tokens == len(prompt)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert "<|im_end|>" not in choice.message.content
    ids = default_engine.tokenizer.encode(choice.message.content, add_special_tokens=False)
    greedy, eos = reference.greedy(prompt, 12), default_engine.tokenizer.eos_token_id
    want = greedy[: greedy.index(eos) + 1] if eos in greedy else greedy
    # The reply's tokens: a greedy continuation of the rendered prompt (EOS ends it, adding no text).
    assert ids == want[: len(ids)]
    logprobs = reference.logprobs(prompt + want)
    for i, (token, lp) in enumerate(zip(want, choice.logprobs.content, strict=True)):
        assert lp.logprob == pytest.approx(logprobs[len(prompt) + i - 1, token].item(), abs=1e-4)
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-6)


async def test_a_sample_reports_the_models_logprobs_and_the_extension_the_processed_ones(
    served: Frontends, default_engine: Engine, reference: Reference, prompt: list[int]
) -> None:
    """At T=0.7 the logprobs are log_softmax(logits), as OpenAI and `vllm serve` give them; with
    `salience.logprobs: processed` the same sample's are log_softmax(logits / 0.7). Both run in
    one batch: the engine serves each request its own rule."""

    def sample(**extra) -> list:
        reply = client(served).chat.completions.create(
            model=NAME,
            messages=QUESTION,
            max_tokens=8,
            temperature=0.7,
            seed=7,
            logprobs=True,
            top_logprobs=3,
            **extra,
        )
        return reply.choices[0].logprobs.content

    raw, processed = await asyncio.gather(
        asyncio.to_thread(sample),
        asyncio.to_thread(sample, extra_body={"salience": {"logprobs": "processed"}}),
    )
    pieces = token_text(default_engine.tokenizer)
    by_bytes = {pieces.bytes(i): i for i in range(default_engine.vocab_size)}
    sampled = [by_bytes[bytes(lp.bytes)] for lp in raw]
    assert sampled == [by_bytes[bytes(lp.bytes)] for lp in processed]  # the same seed: the same sample
    logits = reference.logits(prompt + sampled)[len(prompt) - 1 : -1]
    for content, rows in ((raw, logits.log_softmax(-1)), (processed, (logits / 0.7).log_softmax(-1))):
        for token, lp, row in zip(sampled, content, rows, strict=True):
            assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
            top = row.topk(3)
            assert [by_bytes[bytes(alt.bytes)] for alt in lp.top_logprobs] == top.indices.tolist()
            assert [alt.logprob for alt in lp.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(raw, processed, strict=True)) > 1e-2


async def test_a_stream_says_the_same_and_ends_with_its_usage(served: Frontends) -> None:
    def run() -> tuple[str, list]:
        whole = client(served).chat.completions.create(model=NAME, messages=QUESTION, max_tokens=12, temperature=0)
        chunks = list(
            client(served).chat.completions.create(
                model=NAME,
                messages=QUESTION,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        return whole.choices[0].message.content, chunks

    text, chunks = await asyncio.to_thread(run)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


async def test_async_completions_on_token_ids_and_a_repeat_reads_the_prefix_cache(
    served: Frontends, reference: Reference, prompt: list[int]
) -> None:
    long = prompt * 6  # past a 128-token KV block, so a repeat can read one from the cache
    api = openai.AsyncOpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0)
    first = await api.completions.create(model=NAME, prompt=long, max_tokens=4, temperature=0, logprobs=2)
    again = await api.completions.create(model=NAME, prompt=long, max_tokens=4, temperature=0, logprobs=2)
    await api.close()
    assert first.choices[0].text == again.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= len(long) // 128 * 128 > 0
    want = reference.greedy(long, 4)
    logprobs = reference.logprobs(long + want)
    got = first.choices[0].logprobs.token_logprobs  # up to 4: EOS may end it sooner
    assert got == pytest.approx(
        [logprobs[len(long) + i - 1, t].item() for i, t in enumerate(want[: len(got)])], abs=1e-4
    )


async def test_readouts_ride_with_each_token_as_the_core_gives_them_to_lmtp(
    served: Frontends, default_engine: Engine, prompt: list[int]
) -> None:
    extension = {"salience": {"readouts": {"format": "running", "over": "completion"}}}
    reply = await asyncio.to_thread(
        lambda: client(served).chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=6, temperature=0, extra_body=extension
        )
    )
    extra = reply.choices[0].model_extra["salience"]
    options = SamplingOptions(max_tokens=6, temperature=0.0)
    generation = default_engine.generate(
        prompt, options, probes=Probes(readout_ranges=[(len(prompt), 10**6)], readout_view=ReadoutView.RUNNING)
    )
    events = [e async for e in generation]
    assert [t["position"] for t in extra["tokens"]] == [e.position for e in events]
    for token, event in zip(extra["tokens"], events, strict=True):
        assert token["readout"] == pytest.approx(list(event.readout), abs=1e-5)
    summary = extra["summary"]
    layout = reply.model_extra["salience"]
    assert set(summary) <= set(layout["concepts"]) and summary
    for concept, read in summary.items():  # in the running view: the completion's p, at its last token
        column = layout["layers"].index(read["layer"]) * len(layout["concepts"]) + layout["concepts"].index(concept)
        assert read["running"] == extra["tokens"][-1]["readout"][column] and "mean" not in read
    plain = await asyncio.to_thread(
        lambda: client(served).chat.completions.create(model=NAME, messages=QUESTION, max_tokens=2, temperature=0)
    )
    assert "salience" not in (plain.model_extra or {}) and "salience" not in (plain.choices[0].model_extra or {})


async def test_a_stop_monitor_ends_the_choice_and_steering_changes_it(served: Frontends) -> None:
    monitor = {"concept": "french", "above": 0.0001, "action": "stop"}  # holds at once
    stopped = await asyncio.to_thread(
        lambda: client(served).chat.completions.create(
            model=NAME,
            messages=QUESTION,
            max_tokens=12,
            temperature=0,
            extra_body={"salience": {"monitors": [monitor]}},
        )
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "content_filter"
    assert choice.model_extra["salience"]["stopped_by"]["concept"] == "french"
    assert stopped.usage.completion_tokens == 1

    def reply(**extra) -> str:
        return (
            client(served)
            .chat.completions.create(model=NAME, messages=QUESTION, max_tokens=12, temperature=0, **extra)
            .choices[0]
            .message.content
        )

    steer = {"salience": {"steer": [{"direction": "french", "layers": 12, "value": 64}]}}
    plain, steered = await asyncio.to_thread(reply), await asyncio.to_thread(reply, extra_body=steer)
    assert plain != steered


@pytest.mark.parametrize(
    ("body", "param", "error"),
    [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", openai.BadRequestError),
        ({"messages": []}, "messages", openai.BadRequestError),
        ({"messages": [{"role": "user", "content": [PNG]}]}, "messages[0].content[0]", openai.BadRequestError),
        (
            {"messages": [{"role": "user", "content": [HTTP_IMAGE]}]},
            "messages[0].content[0].image_url.url",
            openai.BadRequestError,
        ),
        ({"top_logprobs": 25, "logprobs": True}, "top_logprobs", openai.BadRequestError),
        ({"model": "nobody"}, None, openai.NotFoundError),
        ({"extra_body": {"salience": {"readout": {}}}}, "salience.readout", openai.BadRequestError),
        (
            {"extra_body": {"salience": {"monitors": [{"concept": "french", "above": 0.5}] * 17}}},
            "salience.monitors",
            openai.BadRequestError,
        ),
    ],
)
async def test_bad_input_raises_the_documented_exception(served: Frontends, body: dict, param, error) -> None:
    request = {"model": NAME, "messages": QUESTION, "max_tokens": 2, **body}
    with pytest.raises(error) as raised:
        await asyncio.to_thread(lambda: client(served).chat.completions.create(**request))
    if param is not None:
        assert raised.value.param == param
    assert (await asyncio.to_thread(lambda: client(served).models.list())).data  # the server carries on


async def test_a_missing_model_names_model(served: Frontends) -> None:
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{served.http}/v1/chat/completions", json={"messages": QUESTION})
        assert response.status == 400 and (await response.json())["error"]["param"] == "model"


async def test_a_token_server_refuses_a_wrong_key_with_an_openai_error(default_engine: Engine) -> None:
    async with frontends(
        default_engine, NAME, lmtp=LmtpConfig(tokens=Tokens(TOKEN)), grpc_tokens=Tokens(TOKEN)
    ) as served:
        with pytest.raises(openai.AuthenticationError):
            await asyncio.to_thread(lambda: client(served, api_key="wrong").models.list())
        models = await asyncio.to_thread(lambda: client(served, api_key=TOKEN).models.list())
        assert NAME in [m.id for m in models.data]


async def test_an_abandoned_stream_is_aborted_in_vllm(served: Frontends, default_engine: Engine) -> None:
    eos = default_engine.tokenizer.eos_token_id
    body = {"model": NAME, "messages": QUESTION, "max_tokens": 1500, "stream": True, "logit_bias": {str(eos): -100}}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{served.http}/v1/chat/completions", json=body)
        assert response.status == 200
        tokens = 0
        while tokens < 3:  # the reply is streaming: the request runs in vLLM
            tokens += b'"content":"' in await response.content.readline()
        assert default_engine.num_unfinished_requests() == 1
        response.close()
    for _ in range(50):
        if default_engine.num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.1)
    assert default_engine.num_unfinished_requests() == 0


async def test_langchain_chat_openai_runs_a_turn(served: Frontends) -> None:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{served.http}/v1", api_key="unused", model=NAME, temperature=0, max_tokens=12)
    message = await chat.ainvoke([("system", "You are brief."), ("human", "What is 2 + 2?")])
    assert message.content and "<|im_end|>" not in message.content
