"""`/v1/responses` on the default engine, driven by the official `openai` client: a response is the
chat path's reply (the same greedy text and prompt), a stream's events are the SDK's and add up to
the same response, a stored three-turn `previous_response_id` chain carries its history and reads
it from the prefix cache, `text.format` and a forced function call constrain the output and a
`function_call_output` continues the chain, GET and DELETE find a stored response only for its
client, and stored responses are bounded and expire as sessions (a store past the client's bound
is a 429 with Retry-After). The request and event shapes are checked sans I/O too, with pydantic's
validation of the SDK's types."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pydantic
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from salience.auth import Client, ClientLimits, Tokens, token_digest
from salience.core.engine.chat_messages import ChatMessage, TextPart, ToolCall
from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionLimits, SessionStore
from salience.errors import NotFound, ResourceExhausted
from salience.lmtp.session import LmtpConfig
from salience.openai.choices import Step
from salience.openai.errors import ApiError
from salience.openai.response_events import Events, ResponseObject
from salience.openai.response_store import ResponseStore, Stored
from salience.openai.responses import Collected
from salience.openai.responses_api import parse_responses
from salience.openai.tool_calls import Reply
from tests.inprocess import Frontends, frontends

NAME = "SmolLM2-135M-Instruct"
BRIEF = "You are brief."
ASK = "What is 2 + 2?"
# Long enough that the turns after the first read whole 128-token blocks of it from the cache.
RULES = "You answer questions about numbers. " + " ".join(f"Rule {i}: be exact about number {i}." for i in range(40))
BLOCK = 128
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest_asyncio.fixture(scope="module")
async def served(default_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(default_engine, NAME) as served:
        yield served


@pytest.fixture(scope="module")
def tokenizer(default_model: Path):
    return AutoTokenizer.from_pretrained(default_model)


def client(served: Frontends, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key=api_key, max_retries=0)


def rendered(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


BAD = [
    ({"input": "hi"}, "model"),
    ({"model": NAME}, "input"),
    ({"model": NAME, "input": []}, "input"),
    ({"model": NAME, "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"model": NAME, "input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"model": NAME, "input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
    ({"model": NAME, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": NAME, "input": "hi", "temperature": 3}, "temperature"),
    (
        {"model": NAME, "input": "hi", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}},
        "text.format.name",
    ),
    (
        {"model": NAME, "input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": 5}}},
        "text.format.schema",
    ),
    ({"model": NAME, "input": "hi", "previous_response_id": ""}, "previous_response_id"),
    ({"model": NAME, "input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"model": NAME, "input": "hi", "frequency_penalty": 1}, "frequency_penalty"),
    ({"model": NAME, "input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    (
        {"model": NAME, "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 3}]},
        "tools[0].parameters",
    ),
    (
        {"model": NAME, "input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "g"}},
        "tool_choice",
    ),
    ({"model": NAME, "input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"model": NAME, "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"model": NAME, "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_a_bad_request_is_a_400_naming_its_param(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_responses(json.dumps(body).encode())
    assert (refused.value.status, refused.value.param) == (400, param)


def test_input_items_become_the_chat_requests_messages() -> None:
    body = {
        "model": NAME,
        "instructions": BRIEF,
        "input": [
            {"role": "user", "content": ASK},
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "4", "annotations": []}],
            },
            {"role": "user", "content": [{"type": "input_text", "text": "And 3 + 3?"}]},
        ],
        "max_output_tokens": 5,
        "top_p": 0.5,
        "metadata": {"k": "v"},
        "tools": [],
    }
    ask = parse_responses(json.dumps(body).encode())
    said = ChatMessage(role="assistant", content=(TextPart(text="4"),))
    assert ask.messages((said,))[:2] == (ChatMessage(role="system", content=BRIEF), said)
    assert [m.role for m in ask.messages(())] == ["system", "user", "assistant", "user"]
    assert (ask.chat.sampling.max_tokens, ask.chat.sampling.top_p, ask.store) == (5, 0.5, True)
    assert ask.echo["metadata"] == {"k": "v"} and ask.echo["text"] == {"format": {"type": "text"}}


def test_function_call_items_join_the_assistant_turn_before_them() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        call,
        {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
    ]
    ask = parse_responses(
        json.dumps({"model": NAME, "input": items, "tools": [WEATHER], "tool_choice": "required"}).encode()
    )
    assistant = ask.input[1]
    assert [m.role for m in ask.input] == ["user", "assistant", "tool", "tool"]
    assert [c.id for c in assistant.tool_calls] == ["call_1", "call_2"] and assistant.content == (
        TextPart(text="Looking."),
    )
    assert ask.input[2].tool_call_id == "call_1" and ask.input[3].content == (TextPart(text="Rain"),)
    assert ask.chat.tool_choice.mode == "required" and ask.chat.sampling.structured_outputs is not None
    with pytest.raises(ApiError) as both:
        parse_responses(
            json.dumps(
                {
                    "model": NAME,
                    "input": "hi",
                    "tools": [WEATHER],
                    "tool_choice": "required",
                    "text": {"format": {"type": "json_object"}},
                }
            ).encode()
        )
    assert both.value.param == "tool_choice"


def test_a_response_and_its_events_validate_as_the_sdks_types() -> None:
    """Checked with pydantic's validation, stricter than the SDK's parsing, which takes anything."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events_type = TypeAdapter(ResponseStreamEvent)
    ask = parse_responses(
        json.dumps({"model": NAME, "input": "hi", "tools": [WEATHER], "max_output_tokens": 9}).encode()
    )
    counts = {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    call_delta = {
        "index": 0,
        "id": "call_9",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"ci'},
    }
    steps = [
        Step("It is", None),
        Step("", None, calls=[call_delta]),
        Step("", None, calls=[{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]),
        Step("", None, finish="length"),
    ]
    steps[-1].reply = Reply(
        "It is", (ToolCall(id="call_9", name="get_weather", arguments='{"city": "Oslo"}'),), (None,)
    )
    reply = ResponseObject("resp_1", 0, NAME, ask.echo)
    events, collected = Events(reply), Collected(0)
    data = events.opening()
    for step in steps:
        collected.add(step)
        data += events.step(step)
    closing, whole = events.closing(collected, counts)
    parsed = [
        events_type.validate_json(chunk.split(b"\ndata: ", 1)[1]) for chunk in (data + closing).split(b"\n\n")[:-1]
    ]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert [e.type for e in parsed][-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    ended = Response.model_validate(whole)
    assert [i.type for i in ended.output] == ["message", "function_call"] and ended.output_text == "It is"
    assert ended.incomplete_details.reason == "max_output_tokens" and ended.usage.output_tokens == 3
    assert Response.model_validate(reply.whole(collected, counts)).output == ended.output


async def test_a_response_is_the_chat_reply_and_its_stream_adds_up_to_it(served: Frontends, tokenizer) -> None:
    def run():
        api = client(served)
        chat = api.chat.completions.create(
            model=NAME,
            messages=[{"role": "system", "content": BRIEF}, {"role": "user", "content": ASK}],
            max_tokens=16,
            temperature=0,
        )
        plain = api.responses.create(
            model=NAME, instructions=BRIEF, input=ASK, max_output_tokens=16, temperature=0, store=False
        )
        events = list(
            api.responses.create(
                model=NAME, instructions=BRIEF, input=ASK, max_output_tokens=16, temperature=0, stream=True
            )
        )
        return chat, plain, events

    chat, plain, events = await asyncio.to_thread(run)
    assert plain.object == "response" and plain.id.startswith("resp_")
    assert plain.output_text == chat.choices[0].message.content and plain.output_text
    assert plain.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    prompt = [{"role": "system", "content": BRIEF}, {"role": "user", "content": ASK}]
    assert plain.usage.input_tokens == rendered(tokenizer, prompt) == chat.usage.prompt_tokens
    assert plain.usage.output_tokens == chat.usage.completion_tokens
    assert plain.instructions == BRIEF and plain.max_output_tokens == 16

    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{plain.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    ended = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert ended.output_text == events[-4].text == plain.output_text
    assert ended.usage.output_tokens == plain.usage.output_tokens and ended.id == events[0].response.id


async def test_a_stored_chain_carries_its_history_from_the_prefix_cache(served: Frontends, tokenizer) -> None:
    questions = ["What is 7 + 5?", "And doubled?", "Minus three?"]

    def run():
        api = client(served)
        chain, previous = [], None
        for question in questions:
            previous = api.responses.create(
                model=NAME,
                instructions=RULES,
                input=question,
                previous_response_id=previous.id if previous else None,
                max_output_tokens=12,
                temperature=0,
            )
            chain.append(previous)
        return chain, api.responses.retrieve(chain[0].id)

    chain, fetched = await asyncio.to_thread(run)
    conversation = [{"role": "system", "content": RULES}]
    for question, response in zip(questions, chain, strict=True):
        conversation.append({"role": "user", "content": question})
        assert response.usage.input_tokens == rendered(tokenizer, conversation)  # the whole history, read
        conversation.append({"role": "assistant", "content": response.output_text})
    for later in chain[1:]:
        # only what the turn adds is computed: the history's whole blocks come from the cache
        cached = later.usage.input_tokens_details.cached_tokens
        assert cached >= (later.usage.input_tokens - 40) // BLOCK * BLOCK >= BLOCK
    assert chain[2].previous_response_id == chain[1].id
    assert fetched.id == chain[0].id and fetched.output_text == chain[0].output_text

    def deleted() -> None:
        api = client(served)
        api.responses.delete(chain[0].id)
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(chain[0].id)
        with pytest.raises(openai.NotFoundError) as refused:
            api.responses.create(model=NAME, input="hi", previous_response_id=chain[0].id, max_output_tokens=2)
        assert refused.value.body["param"] == "previous_response_id"
        assert api.responses.retrieve(chain[1].id).id == chain[1].id  # its follow-ups stay

    await asyncio.to_thread(deleted)


async def test_an_input_with_no_room_for_its_output_is_a_400_naming_input(served: Frontends) -> None:
    """Core names its prompt; the Responses API calls that `input` (chat calls it `messages`)."""

    def refused(**ask) -> dict:
        with pytest.raises(openai.BadRequestError) as bad:
            client(served).responses.create(model=NAME, store=False, **ask)
        return bad.value.body

    body = await asyncio.to_thread(refused, input=RULES, max_output_tokens=2048)
    assert (body["param"], body["code"]) == ("input", "context_length_exceeded"), body
    body = await asyncio.to_thread(refused, input=ASK, max_output_tokens=0)
    assert body["param"] == "max_output_tokens", body


class Sum(pydantic.BaseModel):
    answer: int = pydantic.Field(ge=0, le=99)


async def test_text_format_constrains_the_output(served: Frontends) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "sum", "schema": schema, "strict": True}}

    def run():
        api = client(served)
        reply = api.responses.create(model=NAME, input=ASK, text=text, max_output_tokens=30, temperature=1, store=False)
        # the SDK's helpers: parse sends the pydantic model's schema and validates the reply by it
        parsed = api.responses.parse(model=NAME, input=ASK, text_format=Sum, max_output_tokens=30, store=False)
        with api.responses.stream(model=NAME, input=ASK, text_format=Sum, max_output_tokens=30, store=False) as stream:
            streamed = stream.get_final_response()
        with pytest.raises(openai.BadRequestError) as bad:
            api.responses.create(model=NAME, input=ASK, text={"format": {"type": "xml"}}, store=False)
        return reply, parsed, streamed, bad.value.body

    reply, parsed, streamed, bad = await asyncio.to_thread(run)
    assert reply.status == "completed" and set(json.loads(reply.output_text)) == {"answer"}
    assert reply.text.format.type == "json_schema"
    assert isinstance(parsed.output_parsed, Sum) and isinstance(streamed.output_parsed, Sum)
    assert bad["param"] == "text.format.type"


async def test_the_extension_rides_on_the_message_and_on_each_delta(served: Frontends) -> None:
    extension = {"salience": {"readouts": {"format": "running", "over": "completion"}}}

    def run():
        api = client(served)
        ask = {"model": NAME, "input": ASK, "max_output_tokens": 6, "temperature": 0, "store": False}
        return api.responses.create(**ask, extra_body=extension), list(
            api.responses.create(**ask, stream=True, extra_body=extension)
        )

    whole, events = await asyncio.to_thread(run)
    assert set(whole.model_extra["salience"]) >= {"concepts", "layers", "format", "tokens"}
    tokens = whole.model_extra["salience"]["tokens"]
    assert 1 <= len(tokens) == whole.usage.output_tokens <= 6 and all(len(t["readout"]) > 0 for t in tokens)
    streamed = [
        t for e in events if e.type == "response.output_text.delta" for t in e.model_extra["salience"]["tokens"]
    ]
    assert [t["position"] for t in streamed] == [t["position"] for t in tokens]
    assert events[0].response.model_extra["salience"] == {
        k: whole.model_extra["salience"][k] for k in ("concepts", "layers", "format")
    }
    assert [t["position"] for t in events[-1].response.model_extra["salience"]["tokens"]] == [
        t["position"] for t in tokens
    ]
    plain = await asyncio.to_thread(
        lambda: client(served).responses.create(model=NAME, input=ASK, max_output_tokens=2, store=False)
    )
    assert "salience" not in plain.model_extra


async def test_a_forced_call_and_its_output_continue_the_chain(served: Frontends) -> None:
    forced = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}

    def run():
        api = client(served)
        # Greedy: sampled, a forced call's grammar lets the model spend its tokens on whitespace and
        # end cut short (a full run once got '{\n  "city": "Maclethair,"' in 40 tokens), which is
        # the length limit working, not the chain this test is about.
        ask = {"model": NAME, "input": "What is the weather in Paris?", "max_output_tokens": 40, "temperature": 0}
        first = api.responses.create(**ask, **forced)
        events = list(api.responses.create(**ask, **forced, stream=True, store=False))
        answer = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "Sunny, 21 C"}
        second = api.responses.create(
            model=NAME,
            previous_response_id=first.id,
            input=[answer],
            tools=[WEATHER],
            max_output_tokens=12,
            temperature=0,
        )
        # the same turn with the history sent back by the client: its output items as input
        history = [{"role": "user", "content": ask["input"]}, *first.output, answer]
        resent = api.responses.create(
            model=NAME, input=history, tools=[WEATHER], max_output_tokens=12, temperature=0, store=False
        )
        with pytest.raises(openai.BadRequestError) as bad:
            api.responses.create(model=NAME, input=[{**answer, "call_id": "call_x"}], store=False)
        return first, events, second, resent, bad.value.body

    first, events, second, resent, bad = await asyncio.to_thread(run)
    assert (resent.output_text, resent.usage.input_tokens) == (second.output_text, second.usage.input_tokens)
    assert [item.type for item in first.output] == ["function_call"] and first.status == "completed"
    call = first.output[0]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == deltas == events[-1].response.output[0].arguments
    assert set(json.loads(deltas)) == {"city"} and kinds[-1] == "response.completed"
    assert second.output[0].type == "message" and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert bad["param"] == "input[0].call_id"


def test_stored_responses_are_bounded_and_expire_as_sessions() -> None:
    now = [0.0]
    sessions = SessionStore(lambda: None, SessionLimits(ttl=60, max_sessions=2, max_tokens=100), clock=lambda: now[0])
    store, alice = ResponseStore(sessions), Client(name="alice", scopes=frozenset())
    said = (ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="hello"))

    def stored(tokens: int) -> str:
        response_id = store.reserve(alice)
        store.keep(response_id, alice, said, list(range(tokens)), tokens // 2, Stored({"id": response_id}, said))
        return response_id

    first, second = stored(40), stored(40)
    assert store.find(first, alice).history == said and len(sessions) == 2
    third = stored(10)  # past --max-sessions: the least recently used goes (`find` used the first)
    with pytest.raises(NotFound):
        store.find(second, alice)
    with pytest.raises(ResourceExhausted):  # more tokens than the store holds at all
        stored(101)
    assert len(sessions) == 2
    now[0] += 61  # idle past the TTL
    for response_id in (first, third):
        with pytest.raises(NotFound):
            store.find(response_id, alice)
    assert len(sessions) == 0


def token(name: str) -> str:
    return f"token-of-{name}"


async def test_a_stored_response_is_its_clients_alone_and_bounded(default_engine: Engine) -> None:
    scopes = frozenset({"generate"})
    clients = [
        (token_digest(token("alice")), Client(name="alice", scopes=scopes)),
        (token_digest(token("bob")), Client(name="bob", scopes=scopes, limits=ClientLimits(sessions=1))),
    ]
    tokens = Tokens(clients=clients)
    async with frontends(default_engine, NAME, lmtp=LmtpConfig(tokens=tokens), grpc_tokens=tokens) as served:

        def run() -> None:
            alice, bob = client(served, token("alice")), client(served, token("bob"))
            mine = alice.responses.create(model=NAME, input=ASK, max_output_tokens=4, temperature=0)
            unknown = "resp_no-such-response"
            for response_id in (mine.id, unknown):  # another's is as unknown, word for word
                with pytest.raises(openai.NotFoundError) as refused:
                    bob.responses.create(model=NAME, input="hi", previous_response_id=response_id, max_output_tokens=2)
                assert (
                    refused.value.body["message"]
                    == f"no response {response_id!r}: it was deleted, expired, or never existed"
                )
                with pytest.raises(openai.NotFoundError):
                    bob.responses.retrieve(response_id)
                with pytest.raises(openai.NotFoundError):
                    bob.responses.delete(response_id)
            assert alice.responses.retrieve(mine.id).output_text == mine.output_text

            bob.responses.create(model=NAME, input=ASK, max_output_tokens=2)  # his one stored response
            with pytest.raises(openai.RateLimitError) as bounded:
                bob.responses.create(model=NAME, input=ASK, max_output_tokens=2)
            assert int(bounded.value.response.headers["Retry-After"]) > 0
            assert bob.responses.create(model=NAME, input=ASK, max_output_tokens=2, store=False).output_text is not None

        await asyncio.to_thread(run)
