"""Structured outputs on the OpenAI API, with the official `openai` client on the default model:
`chat.completions.parse(response_format=Model)` validates every sample at temperature 1,
json_object, regex, choice and grammar hold, vLLM's extras take effect, and a bad constraint is a
400 naming its param while another stream runs on."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Literal

import aiohttp
import openai
import pydantic
import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from tests.engines import settled
from tests.inprocess import Frontends, frontends

NAME = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe Paris: its name, its country and its population."}]


class City(pydantic.BaseModel):
    name: str
    country: str
    population: int
    continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


@pytest_asyncio.fixture
async def api(served: Frontends) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{served.http}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()


async def test_parse_gives_a_valid_model_in_20_of_20_samples_at_temperature_1(api: openai.AsyncOpenAI) -> None:
    async def parse(seed: int) -> City:
        reply = await api.chat.completions.parse(
            model=NAME, messages=ASK, response_format=City, temperature=1.0, seed=seed, max_completion_tokens=1000
        )
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.parsed

    cities = await asyncio.gather(*(parse(seed) for seed in range(20)))
    assert all(isinstance(city, City) for city in cities)  # the client validated each one
    assert len({city.model_dump_json() for city in cities}) > 10  # samples, not one answer twenty times


async def test_json_object_gives_a_json_object_on_both_endpoints(api: openai.AsyncOpenAI) -> None:
    chat = await api.chat.completions.create(
        model=NAME, messages=ASK, response_format={"type": "json_object"}, n=4, max_tokens=500, seed=1
    )
    for choice in chat.choices:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    completion = await api.completions.create(
        model=NAME,
        prompt="Two plus two, as JSON:",
        max_tokens=60,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}},
    )
    assert set(json.loads(completion.choices[0].text)) == {"answer"}


@pytest.mark.parametrize(
    ("constraint", "matches"),
    [
        ({"regex": r"[A-Z][a-z]+, [0-9]{4}"}, re.compile(r"[A-Z][a-z]+, [0-9]{4}").fullmatch),
        ({"choice": ["Paris", "London", "Rome"]}, lambda text: text in ("Paris", "London", "Rome")),
        (
            {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'},
            re.compile(r"The answer is (yes|no)\.").fullmatch,
        ),
    ],
    ids=["regex", "choice", "grammar"],
)
async def test_vllms_structured_outputs_hold_on_every_sample(
    api: openai.AsyncOpenAI, constraint: dict, matches
) -> None:
    reply = await api.chat.completions.create(
        model=NAME, messages=ASK, n=6, max_tokens=40, extra_body={"structured_outputs": constraint}
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and matches(choice.message.content), choice.message.content


async def test_vllms_sampling_extras_take_effect(api: openai.AsyncOpenAI, default_engine: Engine) -> None:
    eos = default_engine.tokenizer.eos_token_id

    async def reply(**extra) -> openai.types.chat.ChatCompletion:
        return await api.chat.completions.create(
            model=NAME, messages=ASK, max_tokens=24, temperature=0, extra_body=extra
        )

    plain = await reply()
    assert plain.choices[0].finish_reason == "length"  # a 24-token reply does not end by itself
    first = default_engine.tokenizer.encode(plain.choices[0].message.content)[0]
    assert (await reply(stop_token_ids=[first])).usage.completion_tokens == 1
    assert (await reply(stop_token_ids=[first], min_tokens=5)).usage.completion_tokens > 5
    kept = await reply(stop_token_ids=[first], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == default_engine.tokenizer.decode([first])
    # EOS ignored: its text is in the reply only when special tokens are not skipped
    short = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40, "temperature": 0}
    skipped = await api.chat.completions.create(model=NAME, **short, extra_body={"ignore_eos": True})
    shown = await api.chat.completions.create(
        model=NAME, **short, extra_body={"ignore_eos": True, "skip_special_tokens": False}
    )
    assert skipped.usage.completion_tokens == shown.usage.completion_tokens == 40
    special = default_engine.tokenizer.decode([eos])
    assert special in shown.choices[0].message.content and special not in skipped.choices[0].message.content
    sampled = await reply(temperature=1.0, seed=3, top_k=1, min_p=0.5, repetition_penalty=1.0)
    assert sampled.choices[0].message.content == plain.choices[0].message.content  # top_k 1: greedy


BAD = [
    ({"extra_body": {"structured_outputs": {"regex": "[0-9"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "json_object": True}}}, "structured_outputs"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= " + '"a" ' * 20000}}}, "structured_outputs.grammar"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        "response_format.json_schema.schema",
    ),
    (  # a feature no backend has
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            }
        },
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
        "structured_outputs",
    ),
    ({"extra_body": {"min_tokens": 50}}, "min_tokens"),  # past max_tokens
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),  # vLLM's range
    ({"extra_body": {"stop_token_ids": [10**6]}}, "stop_token_ids[0]"),  # the model's vocabulary
    ({"extra_body": {"guided_regex": "a"}}, "guided_regex"),  # still unknown
]


async def test_bad_constraints_are_400s_naming_their_param_while_a_stream_runs(
    api: openai.AsyncOpenAI, served: Frontends, default_engine: Engine
) -> None:
    body = {"model": NAME, "messages": ASK, "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{served.http}/v1/chat/completions", json=body)
        assert response.status == 200
        for request, param in BAD:
            with pytest.raises(openai.BadRequestError) as raised:
                await api.chat.completions.create(model=NAME, messages=ASK, max_tokens=8, **request)
                pytest.fail(f"not refused: {request}")
            assert raised.value.param == param, raised.value.message
            assert default_engine.num_unfinished_requests() == 1  # only the stream reached vLLM
        chunks = [line async for line in response.content if line.startswith(b"data: {")]
    assert len(chunks) == 1 + 200  # the role, then every token
    assert json.loads(chunks[-1][6:])["choices"][0]["finish_reason"] == "length"
    assert await settled(default_engine) == 0
