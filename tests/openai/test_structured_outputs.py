"""Structured outputs on the OpenAI API, with the official `openai` client on the default model:
`chat.completions.parse(response_format=Model)` validates every sample at temperature 1,
json_object, regex, choice and grammar hold, vLLM's extras take effect, a bad constraint is a
400 naming its param while another stream runs on, and a JSON reply's readouts per field are its
tokens' readouts."""

from __future__ import annotations

import asyncio
import itertools
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
    assert [choice.index for choice in chat.choices] == list(range(4))
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
        # Bounded: an unbounded [a-z]+ may run to max_tokens at temperature 1 (seen once in 6 samples).
        ({"regex": r"[A-Z][a-z]{1,12}, [0-9]{4}"}, re.compile(r"[A-Z][a-z]{1,12}, [0-9]{4}").fullmatch),
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
        model=NAME, messages=ASK, n=6, max_tokens=40, seed=5, extra_body={"structured_outputs": constraint}
    )
    assert [choice.index for choice in reply.choices] == list(range(6))
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


FIELD_MONITOR = {"concept": "french", "above": 0.5, "action": "flag", "path": "$.city"}
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
    # A monitor watching a field of a JSON reply needs one; its path is a JSONPath.
    ({"extra_body": {"salience": {"monitors": [FIELD_MONITOR]}}}, "salience.monitors[0].path"),
    ({"extra_body": {"salience": {"monitors": [{**FIELD_MONITOR, "path": "city"}]}}}, "salience.monitors"),
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


# ---- readouts per JSON field -----------------------------------------------------------------

PLACE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "location": {"type": "object", "properties": {"country": {"type": "string"}, "lat": {"type": "number"}}},
        "districts": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3},
        "capital": {"type": "boolean"},
    },
    "required": ["name", "location", "districts", "capital"],
}


async def describe_paris(api: openai.AsyncOpenAI, salience: dict, **extra) -> openai.types.chat.ChatCompletion:
    """A greedy reply under PLACE's schema, with the `salience` extension given."""
    return await api.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": PLACE}},
        max_tokens=300,
        temperature=0,
        extra_body={"salience": salience},
        **extra,
    )


def json_leaves(value, at: str = "$") -> list[tuple[str, object]]:
    """(JSONPath, value) of each scalar, in document order (the schema's keys are identifiers)."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in json_leaves(item, f"{at}.{key}")]
    if isinstance(value, list):
        return [leaf for i, item in enumerate(value) for leaf in json_leaves(item, f"{at}[{i}]")]
    return [(at, value)]


def check_spans(texts: list[str], fields: list[dict]) -> None:
    """Every leaf of the parsed reply has its entry, in order: its characters hold the value (a
    string's quotes just outside them), and its tokens are exactly those whose text holds one of them."""
    text = "".join(texts)
    expected = json_leaves(json.loads(text))
    assert [field["path"] for field in fields] == [p for p, _ in expected]
    starts = [sum(map(len, texts[:i])) for i in range(len(texts))]
    for field, (_, value) in zip(fields, expected, strict=True):
        start, end = field["chars"]["start"], field["chars"]["end"]
        quoted = isinstance(value, str)
        assert json.loads(text[start - quoted : end + quoted]) == value
        if start == end:  # an empty string holds no token
            assert "tokens" not in field and "concepts" not in field
            continue
        holding = [i for i, s in enumerate(starts) if s < end and s + len(texts[i]) > start]
        assert (field["tokens"]["first"], field["tokens"]["last"]) == (holding[0], holding[-1])


async def test_a_json_reply_has_readouts_per_field_equal_to_its_tokens_readouts(api: openai.AsyncOpenAI) -> None:
    async def reply(format: str, **extra) -> openai.types.chat.ChatCompletion:
        return await describe_paris(api, {"readouts": {"format": format}}, **extra)

    texts, entries, end = [], [], {}
    async for chunk in await reply("raw", stream=True):
        if not chunk.choices or not (extension := chunk.choices[0].model_extra.get("salience")):
            continue
        if "tokens" in extension:  # a token's chunk: its text, its entry
            texts.append(chunk.choices[0].delta.content or "")
            entries.extend(extension["tokens"])
        end = extension
        finish = chunk.choices[0].finish_reason
    assert finish == "stop" and len(texts) == len(entries)
    fields = end["fields"]  # beside the summary, on the last token's chunk
    assert "summary" in end and len(fields) >= 6
    check_spans(texts, fields)

    # The same greedy reply with its rows in the token view, then in the running view.
    token, running = await reply("token"), await reply("running")
    assert token.choices[0].message.content == running.choices[0].message.content == "".join(texts)
    layout = token.model_extra["salience"]
    concepts, layers = layout["concepts"], layout["layers"]
    token_rows = [entry["readout"] for entry in token.choices[0].model_extra["salience"]["tokens"]]
    running_rows = [entry["readout"] for entry in running.choices[0].model_extra["salience"]["tokens"]]
    compared = 0
    for field in (field for field in fields if "tokens" in field):
        first, last = field["tokens"]["first"], field["tokens"]["last"]
        assert field["concepts"]
        for concept, figures in field["concepts"].items():
            column = layers.index(figures["layer"]) * len(concepts) + concepts.index(concept)
            ps = [row[column] for row in token_rows[first : last + 1]]
            assert figures["mean"] == pytest.approx(sum(ps) / len(ps), abs=1e-6)
            assert figures["max"] == pytest.approx(max(ps), abs=1e-6)
            peak = figures["max_at"]["index"]
            assert first <= peak <= last and ps[peak - first] == pytest.approx(max(ps), abs=1e-6)
            assert figures["running"] == pytest.approx(running_rows[last][column], abs=1e-6)
            compared += 1
    assert compared >= 6


async def test_completions_json_object_replies_have_fields_too(api: openai.AsyncOpenAI) -> None:
    completion = await api.completions.create(
        model=NAME,
        prompt="A city, as a JSON object with its name and population:",
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"json_object": True}, "salience": {"readouts": {}}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    fields, text = choice.model_extra["salience"]["fields"], choice.text
    expected = json_leaves(json.loads(text))
    assert [field["path"] for field in fields] == [p for p, _ in expected] and fields
    for field, (_, value) in zip(fields, expected, strict=True):
        quoted = isinstance(value, str)
        assert field["concepts"] and field["tokens"]["first"] <= field["tokens"]["last"]
        assert json.loads(text[field["chars"]["start"] - quoted : field["chars"]["end"] + quoted]) == value


# ---- monitors on a JSON field ----------------------------------------------------------------


async def test_monitors_with_a_path_act_only_inside_that_field(api: openai.AsyncOpenAI) -> None:
    """A greedy JSON reply read in the token view gives each token's p and, checked against its
    parse, each field's tokens. Then the same reply with a flag monitor on `$.districts[*]` flags
    exactly where that field starts to hold, and a stop monitor on `$.location.country`, whose
    threshold an earlier token already passes, ends the reply at the field's first token."""

    async def reply(**salience) -> openai.types.chat.ChatCompletion:
        return await describe_paris(api, {"readouts": {"format": "token"}, **salience})

    full = await reply()
    texts, entries, end = [], [], {}
    async for chunk in await describe_paris(api, {"readouts": {"format": "token"}}, stream=True):
        if chunk.choices and (extension := chunk.choices[0].model_extra.get("salience")):
            if "tokens" in extension:
                texts.append(chunk.choices[0].delta.content or "")
                entries.extend(extension["tokens"])
            end = extension
    assert "".join(texts) == full.choices[0].message.content and full.choices[0].finish_reason == "stop"
    fields = end["fields"]
    check_spans(texts, fields)  # each field's tokens, as json.loads reads the reply
    layout = full.model_extra["salience"]

    def inside(prefix: str) -> list[bool]:
        """Whether each token holds a character of a leaf at or under `prefix` (a JSONPath)."""
        spans = [f["tokens"] for f in fields if "tokens" in f and re.match(prefix + r"(?=$|[.\[])", f["path"])]
        return [bool(texts[i]) and any(s["first"] <= i <= s["last"] for s in spans) for i in range(len(texts))]

    def ps(concept: str) -> tuple[int, list[float]]:
        """The concept's monitored layer, and its token-view p at each completion token."""
        layer = end["summary"][concept]["layer"]
        column = layout["layers"].index(layer) * len(layout["concepts"]) + layout["concepts"].index(concept)
        return layer, [entry["readout"][column] for entry in entries]

    districts, country = inside(r"\$\.districts\[\d+\]"), inside(r"\$\.location\.country")
    first = country.index(True)
    # A concept that some token before the country passes at least as much as the country's first.
    concept = next(c for c in end["summary"] if any(v > ps(c)[1][first] * 0.999 for v in ps(c)[1][:first]))
    layer, p = ps(concept)

    # flag: where the field holds after a token where it did not (or outside the field)
    watched = sorted({p[i] for i, yes in enumerate(districts) if yes})
    assert len(watched) >= 2
    low, high = max(itertools.pairwise(watched), key=lambda pair: pair[1] - pair[0])  # the widest gap
    threshold = (low + high) / 2
    holds = [yes and value > threshold for yes, value in zip(districts, p, strict=True)]
    expected = [i for i, now in enumerate(holds) if now and not (i and holds[i - 1])]
    monitor = {"concept": concept, "layer": layer, "above": threshold, "action": "flag", "path": "$.districts[*]"}
    flagged = (await reply(monitors=[monitor])).choices[0]
    assert flagged.message.content == full.choices[0].message.content
    flags = [i for i, entry in enumerate(flagged.model_extra["salience"]["tokens"]) if entry.get("monitors")]
    assert flags == expected and flags
    fired = flagged.model_extra["salience"]["tokens"][flags[0]]["monitors"][0]
    assert fired["path"] == "$.districts[*]" and fired["action"] == "flag"

    # stop: inside $.location.country, not at an earlier token that passes the threshold too
    threshold = p[first] * 0.999
    assert any(value > threshold for value in p[:first])  # without its path it would stop sooner
    monitor = {"concept": concept, "layer": layer, "above": threshold, "action": "stop", "path": "$.location.country"}
    stopped = (await reply(monitors=[monitor])).choices[0]
    assert stopped.finish_reason == "content_filter"
    assert stopped.message.content == "".join(texts[: first + 1])
    assert stopped.model_extra["salience"]["stopped_by"]["index"] == first
