"""Structured output from the client libraries people point at `vllm serve`, on the default model at
temperature 1, seeds 0..19, each run one request (the libraries' retries off):

- LangChain's `with_structured_output(Model)` (json_schema, its default) and pydantic-ai's
  `NativeOutput(Model)` send a json_schema `response_format`: every sample validates as the model.
- LangChain's `method="json_mode"` and pydantic-ai's `PromptedOutput(Model)` send only
  `{"type": "json_object"}` (the schema, if anywhere, is in the prompt): every finished reply is a
  JSON object; its shape is the model's to get right, and a 135M model often does not.

What each library put on the wire is recorded from its HTTP client and checked."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest
import pytest_asyncio
from langchain_openai import ChatOpenAI
from pydantic_ai import Agent, NativeOutput, PromptedOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from salience.core.engine.engine import Engine
from tests.inprocess import Frontends, frontends

NAME = "SmolLM2-135M-Instruct"
ASK = "Describe a pet: its species, its name and its age in years."
RUNS = 20
MAX_TOKENS = 300
# A json_object has no bounded fields: the samples that ramble would take all of MAX_TOKENS, and
# twenty of them at that length are most of this module's time. An answer is ~30 tokens.
OBJECT_MAX_TOKENS = 100


# Every field bounded, so a constrained sample ends well inside MAX_TOKENS: with a `name` of any
# length, one of the 20 seeds rambles inside the string for all 300 tokens. (No docstring: pydantic
# would send it as the schema's description, into PromptedOutput's prompt.)
class Pet(pydantic.BaseModel):
    species: Literal["cat", "dog", "rabbit"]
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=30)


@dataclass
class Wire:
    """Each request body a library sent and each (status, body) that came back, in order."""

    base_url: str
    sent: list[dict[str, Any]] = field(default_factory=list)
    replies: list[tuple[int, dict[str, Any]]] = field(default_factory=list)

    def http(self) -> httpx.AsyncClient:
        async def request(request: httpx.Request) -> None:
            self.sent.append(json.loads(request.content))

        async def response(response: httpx.Response) -> None:
            self.replies.append((response.status_code, json.loads(await response.aread())))

        return httpx.AsyncClient(event_hooks={"request": [request], "response": [response]})

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="unused", max_retries=0, http_client=self.http())


def langchain(seed: int, wire: Wire, max_tokens: int = MAX_TOKENS) -> ChatOpenAI:
    return ChatOpenAI(
        model=NAME,
        base_url=wire.base_url,
        api_key="unused",
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        max_retries=0,
        http_async_client=wire.http(),
    )


async def pydantic_ai(
    output: NativeOutput | PromptedOutput, seed: int, wire: Wire, max_tokens: int = MAX_TOKENS
) -> Pet:
    model = OpenAIChatModel(NAME, provider=OpenAIProvider(openai_client=wire.openai()))
    agent = Agent(model, output_type=output, retries=0)
    settings = {"temperature": 1.0, "seed": seed, "max_tokens": max_tokens}
    return (await agent.run(ASK, model_settings=settings)).output


async def langchain_json_schema(seed: int, wire: Wire) -> Pet:
    return await langchain(seed, wire).with_structured_output(Pet).ainvoke(ASK)


async def pydantic_ai_native(seed: int, wire: Wire) -> Pet:
    return await pydantic_ai(NativeOutput(Pet), seed, wire)


async def langchain_json_mode(seed: int, wire: Wire) -> Pet | None:
    keys = 'Answer with a JSON object with keys "species" ("cat", "dog" or "rabbit"), "name" and "age" (an integer).'
    chain = langchain(seed, wire, OBJECT_MAX_TOKENS).with_structured_output(Pet, method="json_mode", include_raw=True)
    return (await chain.ainvoke(f"{ASK} {keys}"))["parsed"]


async def pydantic_ai_prompted(seed: int, wire: Wire) -> Pet:
    return await pydantic_ai(PromptedOutput(Pet), seed, wire, OBJECT_MAX_TOKENS)


Call = Callable[[int, Wire], Awaitable[Any]]


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


async def run(call: Call, served: Frontends) -> tuple[list[Any], Wire]:
    """RUNS seeded calls side by side; a library's exception is a result, so the wire is checked."""
    wire = Wire(f"{served.http}/v1")
    results = await asyncio.gather(*(call(seed, wire) for seed in range(RUNS)), return_exceptions=True)
    assert sorted(body["seed"] for body in wire.sent) == list(range(RUNS))  # one request per run
    assert all(body["temperature"] == 1.0 for body in wire.sent)
    assert [status for status, _ in wire.replies] == [200] * RUNS, wire.replies
    return results, wire


@pytest.mark.parametrize("call", [langchain_json_schema, pydantic_ai_native], ids=lambda call: call.__name__)
async def test_a_json_schema_call_validates_in_every_sample_at_temperature_1(call: Call, served: Frontends) -> None:
    pets, wire = await run(call, served)
    assert all(isinstance(pet, Pet) for pet in pets), pets  # the library parsed and validated each one
    assert len({pet.model_dump_json() for pet in pets}) > RUNS // 2  # samples, not one answer twenty times
    for body in wire.sent:
        form = body["response_format"]
        assert form["type"] == "json_schema" and form["json_schema"]["name"] == "Pet"
        assert form["json_schema"]["schema"]["properties"]["name"]["maxLength"] == 20
    assert all(reply["choices"][0]["finish_reason"] == "stop" for _, reply in wire.replies)


@pytest.mark.parametrize("call", [langchain_json_mode, pydantic_ai_prompted], ids=lambda call: call.__name__)
async def test_a_json_object_call_gives_json_objects(call: Call, served: Frontends) -> None:
    _, wire = await run(call, served)
    assert all(body["response_format"] == {"type": "json_object"} for body in wire.sent)
    assert all(body.get("max_tokens", body.get("max_completion_tokens")) == OBJECT_MAX_TOKENS for body in wire.sent)
    texts = [reply["choices"][0]["message"]["content"] for _, reply in wire.replies]
    assert all(text.lstrip().startswith("{") for text in texts), texts
    finished = [
        text
        for text, (_, reply) in zip(texts, wire.replies, strict=True)
        if reply["choices"][0]["finish_reason"] == "stop"
    ]
    assert len(finished) >= RUNS // 4  # nothing bounds a json_object's length: some run to OBJECT_MAX_TOKENS
    assert all(isinstance(json.loads(text), dict) for text in finished), finished
