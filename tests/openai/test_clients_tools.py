"""Tool calling from the client libraries, on the real engine: the default model (whose template
ignores tools, so the fallback renders them) at temperature 1, seeds 0..n-1, one request a run.

- LangChain's `bind_tools` with a forced tool: a valid call in every one of 20 runs;
- LangChain's `with_structured_output(method="function_calling")` and pydantic-ai's default
  output (a tool, `tool_choice` "required"): valid objects;
- the `openai` client streaming a forced call, and the `salience` extension's readouts per argument;
- `auto` parsed by vLLM's hermes parser on the tiny Qwen2 model with a Hermes-style template;
- errors as OpenAI's error objects, unknown routes under /v1/ included.

(instructor, whose TOOLS mode sends a named function as LangChain's function_calling does, cannot
be installed beside the `openai` vLLM needs (setup.cfg); docs/openai.md#tools has its figures,
measured by hand.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pydantic
import pytest
import pytest_asyncio
from langchain_core.messages import AIMessage
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from salience.core.engine.chat import FALLBACK_TOOLS_TEMPLATE, ChatRenderer, load_chat_template
from salience.core.engine.engine import Engine
from tests.inprocess import Frontends, frontends
from tests.openai.test_clients_structured import ASK, NAME, Pet, Wire, langchain

WEATHER_ASK = "What will the weather be in Oslo over the next days?"


class GetWeather(pydantic.BaseModel):
    """The weather forecast for a city."""

    city: str = pydantic.Field(max_length=20)
    days: int = pydantic.Field(ge=1, le=7)


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "GetWeather", "parameters": GetWeather.model_json_schema()},
}


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


async def runs(call: Callable[[int, Wire], Awaitable[Any]], served: Frontends, n: int) -> tuple[list[Any], Wire]:
    """n seeded calls side by side, each one request at temperature 1; every reply a 200."""
    wire = Wire(f"{served.http}/v1")
    results = await asyncio.gather(*(call(seed, wire) for seed in range(n)))
    assert sorted(body["seed"] for body in wire.sent) == list(range(n))
    assert all(body["temperature"] == 1.0 for body in wire.sent)
    assert [status for status, _ in wire.replies] == [200] * n, wire.replies
    return results, wire


async def test_a_forced_langchain_tool_is_a_valid_call_in_20_of_20_runs(served: Frontends) -> None:
    async def call(seed: int, wire: Wire) -> AIMessage:
        return await langchain(seed, wire).bind_tools([GetWeather], tool_choice="GetWeather").ainvoke(WEATHER_ASK)

    messages, wire = await runs(call, served, 20)
    for message in messages:
        assert [call["name"] for call in message.tool_calls] == ["GetWeather"], message
        GetWeather.model_validate(message.tool_calls[0]["args"])  # raises if the call is not valid
    assert len({json.dumps(m.tool_calls[0]["args"]) for m in messages}) > 1  # samples, not one answer
    assert all(body["tool_choice"]["function"]["name"] == "GetWeather" for body in wire.sent)
    assert all(reply["choices"][0]["finish_reason"] == "tool_calls" for _, reply in wire.replies)


async def test_langchain_function_calling_and_pydantic_ais_tool_output_give_valid_objects(served: Frontends) -> None:
    async def langchain_function_calling(seed: int, wire: Wire) -> Pet:
        return await langchain(seed, wire).with_structured_output(Pet, method="function_calling").ainvoke(ASK)

    async def pydantic_ai_tool_output(seed: int, wire: Wire) -> Pet:
        model = OpenAIChatModel(NAME, provider=OpenAIProvider(openai_client=wire.openai()))
        agent = Agent(model, output_type=Pet, retries=0)  # its default: the output is a tool's arguments
        settings = {"temperature": 1.0, "seed": seed, "max_tokens": 300}
        return (await agent.run(ASK, model_settings=settings)).output

    pets, wire = await runs(langchain_function_calling, served, 5)
    assert all(isinstance(pet, Pet) for pet in pets)
    assert all(body["tool_choice"] == {"type": "function", "function": {"name": "Pet"}} for body in wire.sent)
    pets, wire = await runs(pydantic_ai_tool_output, served, 5)
    assert all(isinstance(pet, Pet) for pet in pets)
    assert all(body["tool_choice"] == "required" for body in wire.sent)


def openai_client(served: Frontends) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0)


async def test_a_streamed_forced_call_sends_openais_deltas_and_reads_each_argument(served: Frontends) -> None:
    asked = {
        "model": NAME,
        "messages": [{"role": "user", "content": WEATHER_ASK}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "GetWeather"}},
        "temperature": 0,
        "max_tokens": 60,
    }
    readouts = {"salience": {"readouts": {"format": "raw", "over": "completion"}}}
    whole = await openai_client(served).chat.completions.create(**asked, extra_body=readouts)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "GetWeather"
    arguments = GetWeather.model_validate_json(call.function.arguments)
    (read,) = choice.model_extra["salience"]["tool_calls"]
    assert read["index"] == 0 and [field["path"] for field in read["fields"]] == ["$.city", "$.days"]
    assert all("french" in field["concepts"] for field in read["fields"])
    assert "fields" not in choice.model_extra["salience"]  # per call, not over the reply's text

    stream = await openai_client(served).chat.completions.create(**asked, stream=True)
    deltas, finish = [], None
    async for chunk in stream:
        for part in chunk.choices:
            deltas += part.delta.tool_calls or []
            finish = part.finish_reason or finish
    assert finish == "tool_calls"
    assert {delta.index for delta in deltas} == {0} and deltas[0].id and deltas[0].function.name == "GetWeather"
    streamed = "".join(delta.function.arguments or "" for delta in deltas)
    assert GetWeather.model_validate_json(streamed) == arguments  # greedy: the same call


async def test_a_monitor_stops_a_reply_inside_a_calls_arguments(served: Frontends) -> None:
    monitor = {"concept": "french", "above": 0.0001, "action": "stop"}  # holds at once
    reply = await openai_client(served).chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": WEATHER_ASK}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
        extra_body={"salience": {"monitors": [monitor]}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "content_filter" and reply.usage.completion_tokens == 1
    assert choice.model_extra["salience"]["stopped_by"]["concept"] == "french"
    assert choice.message.tool_calls is None and choice.message.content  # the array's start, as text


# A whole reply the tiny (random) model is held to, as a Hermes-style model writes a call.
HERMES_CALL = '<tool_call>\n{"name": "GetWeather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_auto_parses_a_hermes_call_on_a_qwen2_template(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # As `--chat-template chatml_tools.jinja`: a template that renders tools, and names hermes.
    renderer = ChatRenderer(tiny_engine.tokenizer, load_chat_template(FALLBACK_TOOLS_TEMPLATE))
    assert renderer.tool_parser == "hermes"
    monkeypatch.setattr(tiny_engine, "chat", renderer)
    regex = "".join("\\" + c if c in "{}[]().*+?^$|\\" else c for c in HERMES_CALL)
    async with frontends(tiny_engine, "tiny") as served:
        asked = await openai_client(served).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": WEATHER_ASK}],
            tools=[WEATHER_TOOL],  # tool_choice: auto, the default with tools
            max_tokens=len(HERMES_CALL),  # room for it, token by character
            stream=stream,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        if stream:
            content, calls, finish = "", {}, None
            async for chunk in asked:
                for part in chunk.choices:
                    content += part.delta.content or ""
                    for delta in part.delta.tool_calls or []:
                        found = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                        found["name"] += delta.function.name or ""
                        found["arguments"] += delta.function.arguments or ""
                    finish = part.finish_reason or finish
            named = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
        else:
            choice = asked.choices[0]
            content, finish = choice.message.content or "", choice.finish_reason
            named = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert (content, finish) == ("", "tool_calls")
    assert named == [("GetWeather", {"city": "Oslo", "days": 3})]


async def test_tool_errors_and_unknown_routes_are_openai_error_objects(served: Frontends) -> None:
    client = openai_client(served)
    ask = {"model": NAME, "messages": [{"role": "user", "content": WEATHER_ASK}], "max_tokens": 4}
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}
    answered = [
        {**ask["messages"][0]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_nobody"},
    ]
    for fields, param in (
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": [bad_schema]}, "tools[0].function.parameters"),
        ({"messages": answered}, "messages[1].tool_call_id"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(**{**ask, **fields})
        assert caught.value.body["param"] == param, caught.value.body

    with pytest.raises(openai.NotFoundError) as caught:  # the SDK shows why
        await client.post("/embeddings", body={"model": NAME, "input": "hi"}, cast_to=object)
    assert caught.value.body == {
        "message": "Invalid URL (POST /v1/embeddings)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{served.http}/v1/models") as wrong_method:
            assert wrong_method.status == 405 and "GET" in wrong_method.headers["Allow"]
            assert (await wrong_method.json())["error"]["message"] == "Invalid URL (POST /v1/models)"
        async with session.get(f"{served.http}/nothing") as elsewhere:  # outside /v1/: aiohttp's own 404
            assert elsewhere.status == 404 and elsewhere.content_type != "application/json"
