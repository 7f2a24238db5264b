"""The OpenAI API's aiohttp adapter on a fake engine, through aiohttp's mocked requests: no socket,
no vLLM. What it translates (auth, ids, statuses, admission, SSE, closing generations) is tested
here; every behaviour is tested against the real engine in the integration tests as well."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from unittest import mock

import orjson
import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request
from openai._streaming import SSEDecoder
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from salience.auth import Tokens
from salience.core.engine.checks import RequestChecks
from salience.core.engine.prompts import Prompt
from salience.core.engine.requests import Constraint, FinishReason, SamplingOptions, TokenEvent
from salience.core.serving.status import ServerStatus
from salience.openai import app as openai_app

VOCAB = ["<s>", "</s>", "Hello", " world", "!", " there"]
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


class Tokenizer:
    eos_token_id = 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(VOCAB[i] for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return VOCAB[token_id].replace(" ", "▁")

    def encode(self, text: str) -> list[int]:
        return [0, 2]


class Chat:
    async def prompt(self, messages: Sequence, tools: Sequence | None = None) -> Prompt:
        return Prompt((0, 2, 3))


class Generation:
    """Yields `tokens`, then ends as `end` says; with `wait`, blocks before the first until set."""

    def __init__(self, engine: Engine, prompt: Sequence[int], options: SamplingOptions, request_id: str) -> None:
        self.engine, self.request_id, self.options = engine, request_id, options
        self.concepts, self.prompt_readouts, self.prompt_rows, self.cached_tokens = None, {}, {}, 2
        self.finish_reason: FinishReason | None = None
        tokens = engine.tokens[: options.max_tokens]
        end = engine.end if len(tokens) == len(engine.tokens) else FinishReason.LENGTH
        self.events = [
            TokenEvent(token_id=t, position=len(prompt) + i, logprob=-0.25, top_logprobs=((t, -0.25),))
            for i, t in enumerate(tokens)
        ]
        if end is not FinishReason.CANCELLED:
            last = self.events[-1]
            self.events[-1] = TokenEvent(
                token_id=last.token_id, position=last.position, logprob=-0.25, top_logprobs=(), finish_reason=end
            )
        self.end = end

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        await self.engine.go.wait()
        if not self.events:
            self.finish_reason = self.finish_reason or self.end
            raise StopAsyncIteration
        event = self.events.pop(0)
        self.finish_reason = event.finish_reason
        return event

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self.engine.closed.append((self.request_id, len(self.events)))

    async def cancel(self) -> None:
        self.finish_reason = FinishReason.CANCELLED


class Engine:
    """What the adapter and run.py read of an Engine."""

    def __init__(self, tokens: Sequence[int] = (2, 3, 4, 1), end: FinishReason = FinishReason.STOP) -> None:
        self.tokenizer, self.chat, self.max_model_len, self.max_logprobs = Tokenizer(), Chat(), 64, 20
        self.checks = RequestChecks(len(VOCAB), 64, 20)
        self.row_budget = mock.Mock(rows=0, held=0, waiting=0)
        self.tokens, self.end = tokens, end
        self.go = asyncio.Event()
        self.go.set()
        self.started: list[tuple[str, int | None]] = []
        self.closed: list[tuple[str, int]] = []

    async def check_constraint(self, constraint: Constraint | None) -> None:
        await self.checks.constraint(constraint)

    def check_tokens(self, what: str, ids: Sequence[int]) -> list[int]:
        return self.checks.tokens(what, ids)

    def generate(self, prompt: Sequence[int], options: SamplingOptions, *, request_id: str, **extra) -> Generation:
        self.started.append((request_id, options.seed))
        return Generation(self, prompt, options, request_id)


class Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


def writer(sent: bytearray) -> mock.Mock:
    """aiohttp's payload writer, keeping what is written."""

    async def write(data: bytes) -> None:
        sent.extend(data)

    out = mock.Mock(write_headers=mock.AsyncMock(), write_eof=mock.AsyncMock(), drain=mock.AsyncMock())
    out.write, out.buffer_size, out.output_size = write, 0, 0
    return out


def served(engine: Engine | None, token: str | None = None) -> tuple[web.Application, ServerStatus]:
    status = ServerStatus("m", ["alias"])
    app = web.Application()
    openai_app.add_routes(app, status, Tokens(token))
    if engine is not None:
        status.ready(engine)
    return app, status


async def call(app: web.Application, path: str, body: dict | None = None, headers: dict | None = None, **kw):
    """The handler's response, and what it wrote (a stream's bytes). The connection stays open
    unless `transport` says otherwise: make_mocked_request's own is a Mock whose is_closing() is
    truthy, so a handler that ran past one POLL_SECONDS (a loaded machine) saw its client gone."""
    kw.setdefault("transport", Transport())
    reader = StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    if body is not None:
        reader.feed_data(orjson.dumps(body))
    reader.feed_eof()
    sent = bytearray()
    method = "GET" if body is None else "POST"
    request = make_mocked_request(method, path, headers or {}, app=app, payload=reader, writer=writer(sent), **kw)
    handler = {
        "/v1/models": openai_app.models,
        "/v1/completions": openai_app.completions,
        "/v1/chat/completions": openai_app.chat_completions,
    }.get(path, openai_app.model)
    if handler is openai_app.model:
        request.match_info["model"] = path.rsplit("/", 1)[-1]
    return await handler(request), bytes(sent)


def events(sent: bytes) -> list[str]:
    return [event.data for event in SSEDecoder().iter_bytes(iter([sent]))]


def error(response: web.Response) -> dict:
    return orjson.loads(response.body)["error"]


async def test_refusals_are_openai_error_objects_with_the_request_id() -> None:
    app, status = served(None, token="secret")
    response, _ = await call(app, "/v1/models")
    assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert error(response)["code"] == "invalid_api_key" and response.headers["x-request-id"]
    ok = {"Authorization": "Bearer secret", "x-request-id": "client-7"}
    response, _ = await call(app, "/v1/chat/completions", CHAT_BODY, ok)
    assert (response.status, error(response)["code"], response.headers["x-request-id"]) == (
        503,
        "unavailable",
        "client-7",
    )
    status.ready(Engine())
    response, _ = await call(app, "/v1/chat/completions", {**CHAT_BODY, "model": "other"}, ok)
    assert (response.status, error(response)["code"]) == (404, "model_not_found")
    response, _ = await call(app, "/v1/models/other", None, ok)
    assert response.status == 404
    response, _ = await call(app, "/v1/chat/completions", {**CHAT_BODY, "guided_regex": "a"}, ok)
    assert (response.status, error(response)["param"]) == (400, "guided_regex")
    response, _ = await call(app, "/v1/chat/completions", CHAT_BODY, {**ok, "x-request-id": "bad id"})
    assert response.status == 400 and response.headers["x-request-id"] != "bad id"
    status.draining()
    response, _ = await call(app, "/v1/models", None, ok)
    assert response.status == 503


async def test_models_lists_the_served_name_first() -> None:
    app, _ = served(Engine())
    response, _ = await call(app, "/v1/models")
    assert [m["id"] for m in orjson.loads(response.body)["data"]] == ["m", "alias"]


async def test_a_whole_chat_completion_with_n_choices() -> None:
    engine = Engine()
    app, status = served(engine)
    body = {**CHAT_BODY, "n": 2, "seed": 5, "logprobs": True}
    response, _ = await call(app, "/v1/chat/completions", body, {"x-request-id": "r-1"})
    parsed = ChatCompletion.model_validate_json(response.body)
    assert parsed.id == "chatcmpl-r-1" and response.headers["x-request-id"] == "r-1"
    assert [c.message.content for c in parsed.choices] == ["Hello world!", "Hello world!"]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "stop"]
    assert engine.started == [("r-1-0", 5), ("r-1-1", 6)]  # choice i decodes with seed + i
    assert parsed.usage.prompt_tokens == 3 and parsed.usage.completion_tokens == 8
    assert status.in_flight == 0


async def test_a_stream_ends_with_usage_and_done() -> None:
    app, status = served(Engine())
    body = {**CHAT_BODY, "stream": True, "stream_options": {"include_usage": True}}
    response, sent = await call(app, "/v1/chat/completions", body)
    assert response.status == 200 and response.headers["Content-Type"] == "text/event-stream"
    data = events(sent)
    assert data[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(d) for d in data[:-1]]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world!"
    assert chunks[-1].usage.total_tokens == 7 and status.in_flight == 0


async def test_a_stop_string_closes_the_generation_before_the_engine_ends_it() -> None:
    engine = Engine()
    app, _ = served(engine)
    response, _ = await call(app, "/v1/completions", {"model": "m", "prompt": "x", "stop": " world"})
    assert orjson.loads(response.body)["choices"][0]["text"] == "Hello"
    assert engine.closed == [(engine.started[0][0], 2)]  # two events never read


async def test_a_server_cancelled_stream_ends_with_an_error_event() -> None:
    app, _ = served(Engine(end=FinishReason.CANCELLED))
    _, sent = await call(app, "/v1/chat/completions", {**CHAT_BODY, "stream": True})
    data = events(sent)
    assert data[-1] == "[DONE]" and orjson.loads(data[-2])["error"]["code"] == "unavailable"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_gone_has_its_generation_closed(stream: bool) -> None:
    engine = Engine()
    engine.go.clear()  # the engine is busy: no token comes
    app, status = served(engine)
    transport = Transport()
    call_task = asyncio.create_task(
        call(app, "/v1/chat/completions", {**CHAT_BODY, "stream": stream}, transport=transport)
    )
    await asyncio.sleep(0.1)
    assert status.in_flight == 1 and engine.closed == []
    transport.closing = True
    response, _ = await asyncio.wait_for(call_task, 2)
    assert response.status == 499
    assert engine.closed == [(engine.started[0][0], 4)] and status.in_flight == 0
