"""Tools without an engine: `tools`/`tool_choice` read (every refusal naming its field), the forced
call's schema against vLLM's own, replies read for their calls (whole and streamed), and the chat
template's rendering of tools, calls and answers, with the fallback for a template that ignores them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import orjson
import pytest
from transformers import AutoTokenizer

from salience.core.engine.chat import FALLBACK_TOOLS_TEMPLATE, ChatRenderer, load_chat_template
from salience.core.engine.chat_messages import parse_messages
from salience.openai.errors import ApiError
from salience.openai.requests import parse_chat
from salience.openai.tool_calls import Calls
from salience.openai.tools import AUTO, NONE, REQUIRED, ToolChoice, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
CALLED = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "content": "-3 C", "tool_call_id": "c1"},
]
HERMES_REPLY = 'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'


def chat(**fields) -> dict:
    return {"model": "m", "messages": ASK, **fields}


def refusal(body: dict) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_chat(orjson.dumps(body))
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(tools={"weather": WEATHER}), "tools"),
        (chat(tools=[{"type": "web_search"}]), "tools[0].type"),
        (
            chat(tools=[{**WEATHER, "function": {**WEATHER["function"], "name": "the weather"}}]),
            "tools[0].function.name",
        ),
        (chat(tools=[WEATHER, WEATHER]), "tools"),
        (
            chat(tools=[TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]),
            "tools[1].function.parameters",
        ),
        (
            chat(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": 7}}}}}
                ]
            ),
            "tools[0].function.parameters",
        ),
        (chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "time"}}), "tool_choice"),
        (chat(tools=[WEATHER], tool_choice="always"), "tool_choice"),
        (chat(tool_choice="auto"), "tool_choice"),
        (chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
        (chat(messages=[*ASK, {"role": "tool", "content": "-3 C", "tool_call_id": "c9"}]), "messages[1].tool_call_id"),
        (chat(messages=[CALLED[0], CALLED[2]]), "messages[1].tool_call_id"),
        (chat(messages=[{**ASK[0], "tool_calls": CALLED[1]["tool_calls"]}]), "messages[0].tool_calls"),
        (
            chat(
                messages=[*ASK, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f"}, "x": 1}]}]
            ),
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_a_bad_tool_field_is_a_400_naming_it(body: dict, param: str) -> None:
    assert refusal(body).param == param


def test_tools_default_to_auto_and_calls_and_answers_are_read() -> None:
    request = parse_chat(orjson.dumps(chat(messages=CALLED, tools=[WEATHER, TIME])))
    assert request.tool_choice == AUTO and [tool.name for tool in request.tools] == ["weather", "time"]
    assert request.sampling.structured_outputs is None  # auto: nothing forced
    call = request.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("c1", "weather", {"city": "Oslo"})
    assert request.messages[1].content == "" and request.messages[2].tool_call_id == "c1"
    assert parse_chat(orjson.dumps(chat(tools=[]))).tool_choice == NONE  # LangChain's neutral value


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [({"type": "function", "function": {"name": "time"}}, True), ("required", True), ("required", False)],
)
def test_a_forced_choice_constrains_to_the_schema_vllm_builds(choice, parallel: bool) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    body = chat(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel)
    constraint = parse_chat(orjson.dumps(body)).sampling.structured_outputs
    assert constraint is not None and constraint.kind == "json"
    theirs = ChatCompletionRequest(**body)
    assert json.loads(constraint.spec) == get_json_schema_from_tools(theirs.tool_choice, theirs.tools, parallel)
    assert constraint.source == ("tools[1].function.parameters" if isinstance(choice, dict) else "tools")


@pytest.fixture(scope="module")
def smol(default_model: Path):
    return AutoTokenizer.from_pretrained(default_model)


def test_auto_reads_hermes_calls_whole_and_streamed_alike(smol) -> None:
    tools = parse_tools([WEATHER, TIME])
    whole = Calls(tools, AUTO, parser="hermes", tokenizer=smol).reply(HERMES_REPLY)
    assert whole.content == "Let me look. " and [c.name for c in whole.calls] == ["weather"]
    assert json.loads(whole.calls[0].arguments) == {"city": "Oslo", "days": 2}
    start, end = whole.spans[0]
    assert json.loads(HERMES_REPLY[start:end]) == {"city": "Oslo", "days": 2}

    stream = Calls(tools, AUTO, parser="hermes", tokenizer=smol, streaming=True)
    content, calls = "", {}
    for at in range(0, len(HERMES_REPLY), 3):  # three characters a token
        text, deltas = stream.feed(HERMES_REPLY[at : at + 3], [0])
        content += text
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.get("id", call["id"])
            call["name"] += delta["function"].get("name", "")
            call["arguments"] += delta["function"].get("arguments", "")
    reply, rest, late = stream.end()
    assert (content, rest, late) == ("Let me look. ", "", [])
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (reply.calls[0].id, "weather", {"city": "Oslo", "days": 2})
    ]
    plain = Calls(tools, AUTO, parser="hermes", tokenizer=smol, streaming=True)
    assert plain.feed("1 < 2 <", [0]) == ("1 < 2 ", [])  # "<" may begin <tool_call>: held back
    reply, rest, _ = plain.end()
    assert (reply.content, reply.calls, rest) == ("1 < 2 <", (), "<")  # and sent at the end


def test_required_and_named_replies_are_their_calls() -> None:
    tools = parse_tools([WEATHER, TIME])
    text = '[{"name": "time", "parameters": {}}, {"name": "weather", "parameters": {"city": "Oslo"}}]'
    required = Calls(tools, REQUIRED, streaming=True)
    assert required.feed(text, [0]) == ("", [])  # the array goes out whole, at the end
    reply, rest, deltas = required.end()
    assert (
        rest == ""
        and reply.content is None
        and [(c.name, c.arguments) for c in reply.calls]
        == [
            ("time", "{}"),
            ("weather", '{"city": "Oslo"}'),
        ]
    )
    assert [(d["index"], d["id"], d["function"]["name"]) for d in deltas] == [
        (0, reply.calls[0].id, "time"),
        (1, reply.calls[1].id, "weather"),
    ]
    assert [text[a:b] for a, b in reply.spans] == ["{}", '{"city": "Oslo"}']
    cut = Calls(tools, REQUIRED).reply('[{"name": "weather", "parameters": {"ci')  # max_tokens ran out
    assert (cut.content, cut.calls) == ('[{"name": "weather", "parameters": {"ci', ())

    named = Calls(tools, ToolChoice("function", "weather"), streaming=True)
    _, first = named.feed('{"city":', [0])
    _, second = named.feed(' "Oslo"}', [0])
    reply, _, _ = named.end()
    assert first == [
        {
            "index": 0,
            "id": reply.calls[0].id,
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":'},
        }
    ]
    assert second == [{"index": 0, "function": {"arguments": ' "Oslo"}'}}]
    assert reply.calls[0].arguments == '{"city": "Oslo"}' and reply.spans == ((0, 16),)


@pytest.mark.parametrize(
    "pieces",
    [
        ["\n ", ' {"city"', ": ", '"Oslo"', "}", " \n", "\t "],  # cut short in whitespace after the object
        ['{\n  "city"', ": ", "", '"Maclethair,"', "\n  ", "  \t"],  # cut short inside it, then whitespace
        ["  ", "", '{"city": "a  b"}'],
    ],
)
def test_a_named_calls_streamed_arguments_join_to_its_arguments(pieces: list[str]) -> None:
    """The deltas a stream sends are the arguments the reply ends with (its text stripped), so
    `function_call_arguments.done` and a chat stream's joined deltas agree with them."""
    named = Calls(parse_tools([WEATHER]), ToolChoice("function", "weather"), streaming=True)
    deltas = [d for piece in pieces for d in named.feed(piece, [0])[1]]
    reply, _, _ = named.end()
    assert deltas[0]["function"]["name"] == "weather" and deltas[0]["id"] == reply.calls[0].id
    assert all(d["function"]["arguments"] for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == reply.calls[0].arguments == "".join(pieces).strip()


def test_the_default_models_template_ignores_tools_so_the_fallback_renders_them(smol) -> None:
    renderer = ChatRenderer(smol)
    assert renderer.tools_template == FALLBACK_TOOLS_TEMPLATE.read_text() and renderer.tool_parser == "hermes"
    tools = [tool.as_json() for tool in parse_tools([WEATHER])]
    text = smol.decode(renderer.render(parse_messages(CALLED), tools=tools))
    assert '"name": "weather", "description": "The weather in a city"' in text  # the tool, in the system turn
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n-3 C\n</tool_response>" in text
    # without tools, the model's own template, exactly as transformers renders it
    plain = smol.apply_chat_template(ASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert renderer.render(parse_messages(ASK)) == tuple(plain)


def test_a_template_that_renders_tools_is_used_with_them(smol) -> None:
    """--chat-template with a tools branch: rendered as transformers renders it with `tools=`."""
    renderer = ChatRenderer(smol, load_chat_template(FALLBACK_TOOLS_TEMPLATE))
    assert renderer.tools_template is renderer.template and renderer.tool_parser == "hermes"
    assert ChatRenderer(smol, tool_parser="llama3_json").tool_parser == "llama3_json"  # the flag wins
    # transformers is given the arguments as an object, as vLLM's server passes them to templates
    conversation = copy.deepcopy(CALLED)
    conversation[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    expected = smol.apply_chat_template(
        conversation,
        tools=[WEATHER],
        chat_template=renderer.template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    tools = [tool.as_json() for tool in parse_tools([WEATHER])]
    assert renderer.render(parse_messages(CALLED), tools=tools) == tuple(expected)
