"""OpenAI's Responses requests, sans I/O: a `POST /v1/responses` body in, a `ResponsesRequest` out,
or an ApiError naming the field.

A Responses request is a chat request in other words, so it becomes the chat endpoint's own
`ApiRequest` and runs on the chat path (run.py): `input` (a text, or message items) becomes chat
messages, `instructions` a system message before them, `max_output_tokens` the reply's budget,
`text.format` the same structured-output Constraint as chat's `response_format`, function
`tools` chat's tools (read by tools.py), a `function_call` item an assistant message's tool call
(consecutive calls, and the message item before them, one assistant message) and a
`function_call_output` item a tool message. What is the
Responses API's own is kept beside it: `store`, `previous_response_id`, and the fields a
response object echoes.

`instructions` belong to one response: a follow-up (`previous_response_id`) reads the earlier
input and output items, not their instructions, as in OpenAI's API; so `history` holds the
items without them.

Fields follow the chat endpoint's rule (requests.py): an unknown one is a 400, those that change
nothing (`metadata`, `user`, ...) are accepted, those asking for what this server does not do are
a 400 unless they carry their neutral value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from salience.core.engine.chat_messages import ChatMessage, ContentPart, ImagePart, TextPart, ToolCall
from salience.core.engine.constraints import constraint
from salience.core.engine.requests import Constraint
from salience.openai.errors import bad_request
from salience.openai.extension import parse_extension
from salience.openai.fields import INT64, Reader, boolean, integer, load, number, read_fields, string
from salience.openai.requests import CHAT, ApiRequest, Sampling, schema_format
from salience.openai.tools import AUTO, NONE, Tool, ToolChoice, check_choice, forced_call, parse_tools

__all__ = ["RESPONSE", "ResponsesRequest", "check_outputs", "parse_responses"]

RESPONSE = "response"  # the endpoint, as metrics name its streams
_ROLES = ("user", "system", "developer", "assistant")  # an input message's
# Core's names that the Responses API calls otherwise: the prompt is the rendering of its input.
RESPONSES_NAMES = MappingProxyType({"prompt": "input", "max_tokens": "max_output_tokens"})
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True, kw_only=True)
class ResponsesRequest:
    """`chat`: the request the chat path runs, without its messages, which `messages` makes once the
    earlier items (`previous_response_id`) are known. `echo`: the fields a response object repeats."""

    chat: ApiRequest
    instructions: str | None
    input: tuple[ChatMessage, ...]
    outputs: tuple[tuple[int, str], ...]  # each function_call_output item: its index and call_id
    store: bool
    previous_response_id: str | None
    echo: dict[str, Any]

    def messages(self, history: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        """The conversation the model reads: these instructions, the earlier items, this input."""
        system = (ChatMessage(role="system", content=self.instructions),) if self.instructions else ()
        return (*system, *history, *self.input)


# ---- input items ---------------------------------------------------------------------------------


def _input(value: Any, name: str) -> tuple[tuple[ChatMessage, ...], tuple[tuple[int, str], ...]]:
    """A text (one user message) or a list of items; and each function_call_output's index and
    call_id (checked against the calls before it once the history is known: `check_outputs`)."""
    if isinstance(value, str):
        return (ChatMessage(role="user", content=value),), ()
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a text or a non-empty list of items", name)
    messages: list[ChatMessage] = []
    outputs = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f'{where} must be an item {{"role": ..., "content": ...}}', where)
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same turn: its text, then its calls
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=(call,)))
        elif kind == "function_call_output":
            messages.append(_output(item, where))
            outputs.append((i, item["call_id"]))
        elif kind == "message":
            messages.append(_message(item, where))
        else:
            raise bad_request(
                f"{where}.type {kind!r} is not supported by this server; send message, function_call and "
                "function_call_output items",
                f"{where}.type",
            )
    return tuple(messages), tuple(outputs)


def _fields(item: dict, where: str, kind: str, fields: Sequence[str]) -> None:
    """No field but `fields` (and an output item's `id` and `status`, when it is sent back), or null."""
    if extra := sorted(k for k, v in item.items() if v is not None and k not in {"type", "id", "status", *fields}):
        raise bad_request(f"{where}.{extra[0]} is not a field of a {kind} item", f"{where}.{extra[0]}")


def _message(item: dict, where: str) -> ChatMessage:
    _fields(item, where, "message", ("role", "content"))
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}", f"{where}.role")
    return ChatMessage(role=role, content=_content(item.get("content"), f"{where}.content"))


def _content(value: Any, where: str) -> str | tuple[ContentPart, ...]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise bad_request(f"{where} must be a text or a non-empty list of parts", where)
    return tuple(_part(p, f"{where}[{j}]") for j, p in enumerate(value))


def _call(item: dict, where: str) -> ToolCall:
    """A function_call item: `{"call_id", "name", "arguments"}`."""
    _fields(item, where, "function_call", ("call_id", "name", "arguments"))
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or (key != "arguments" and not item[key]):
            raise bad_request(
                f"{where}.{key} must be a {'' if key == 'arguments' else 'non-empty '}string", f"{where}.{key}"
            )
    return ToolCall(id=item["call_id"], name=item["name"], arguments=item["arguments"])


def _output(item: dict, where: str) -> ChatMessage:
    """A function_call_output item: `{"call_id", "output"}`, the output a text or parts."""
    _fields(item, where, "function_call_output", ("call_id", "output"))
    if not isinstance(item.get("call_id"), str) or not item["call_id"]:
        raise bad_request(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
    return ChatMessage(
        role="tool", content=_content(item.get("output"), f"{where}.output"), tool_call_id=item["call_id"]
    )


def check_outputs(request: ResponsesRequest, history: Sequence[ChatMessage]) -> None:
    """Each function_call_output answers a call made before it (in the history or the input)."""
    calls = {call.id for message in (*history, *request.input) for call in message.tool_calls}
    for i, call_id in request.outputs:
        if call_id not in calls:
            where = f"input[{i}].call_id"
            raise bad_request(f"{where} {call_id!r} answers no function_call before it", where)


def _part(value: Any, where: str) -> ContentPart:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in _TEXT_PARTS and isinstance(value.get("text"), str):
        return TextPart(text=value["text"])
    if kind == "input_image" and isinstance(value.get("image_url"), str):
        return ImagePart(url=value["image_url"])  # a data: URL; the renderer checks it
    if kind == "refusal" and isinstance(value.get("refusal"), str):
        return TextPart(text=value["refusal"])
    raise bad_request(
        f'{where} must be {{"type": "input_text" or "output_text", "text": ...}} or '
        f'{{"type": "input_image", "image_url": "data:..."}}',
        where,
    )


# ---- text.format -----------------------------------------------------------------------------------


def _text(value: Any, name: str) -> Constraint | None:
    """`text`: `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`, the schema's
    fields beside its type (where chat nests them in `json_schema`)."""
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise bad_request(f'{name} must be {{"format": {{"type": ...}}}}', name)
    if value.get("verbosity") not in (None, "medium"):
        raise bad_request(f"{name}.verbosity is not supported by this server", f"{name}.verbosity")
    spec, where = value.get("format"), f"{name}.format"
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f'{where}.type must be "text", "json_object" or "json_schema"', f"{where}.type")
    allowed = {"type", "name", "schema", "strict", "description"} if kind == "json_schema" else {"type"}
    if extra := sorted(set(spec) - allowed):
        raise bad_request(f"{where}.{extra[0]} is not a field of a {kind} format", f"{where}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return constraint("json_object", True, where)
    return schema_format(spec, where)


def _tool_choice(value: Any, tools: Sequence[Tool], name: str) -> ToolChoice:
    """ "none", "auto", "required", or `{"type": "function", "name"}` naming one of `tools`."""
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "name"}:
        choice = ToolChoice("function", value["name"])
    else:
        raise bad_request(f'{name} must be "none", "auto", "required" or {{"type": "function", "name": ...}}', name)
    check_choice(choice, tools, name)
    return choice


def _previous(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name} must be a response id", name)
    return value


_READERS: dict[str, Reader] = {
    "model": string,
    "input": _input,
    "instructions": string,
    "max_output_tokens": integer(1, INT64 - 1),
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "stream": boolean,
    "store": boolean,
    "previous_response_id": _previous,
    "text": _text,
    "salience": parse_extension,
    "tools": lambda value, name: parse_tools(value, name, flat=True),
    "tool_choice": lambda value, name: value,  # read with the tools it names
    "parallel_tool_calls": boolean,
}
# Accepted, with no effect on what is generated.
_IGNORED = frozenset(
    {"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
)
# Asking for what this server does not do: refused unless neutral.
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "include": lambda v: v == [],
    "truncation": lambda v: v == "disabled",
    "background": lambda v: v is False,
    "reasoning": lambda v: False,
    "top_logprobs": lambda v: v == 0,
    "max_tool_calls": lambda v: False,
    "conversation": lambda v: False,
    "prompt": lambda v: False,
    "stream_options": lambda v: isinstance(v, dict) and set(v) <= {"include_obfuscation"},
}


def parse_responses(body: bytes) -> ResponsesRequest:
    """A `POST /v1/responses` body."""
    data = load(body)
    fields = read_fields(data, _READERS, _IGNORED, _NEUTRAL)
    if "input" not in fields:
        raise bad_request("input is required", "input")
    tools = fields.get("tools", ())
    choice = (
        _tool_choice(fields["tool_choice"], tools, "tool_choice")
        if "tool_choice" in fields
        else AUTO
        if tools
        else NONE
    )
    parallel = fields.get("parallel_tool_calls", True)
    constraint_ = fields.get("text")
    if choice.forced:
        if constraint_ is not None:
            raise bad_request(
                f"tool_choice {choice.name or choice.mode!r} forces a call, and text.format constrains the reply too; "
                "send one of them",
                "tool_choice",
            )
        constraint_ = forced_call(tools, choice, parallel=parallel)
    sampling = {k: fields[k] for k in ("temperature", "top_p") if k in fields}
    messages, outputs = fields["input"]
    return ResponsesRequest(
        chat=ApiRequest(
            kind=CHAT,
            names=RESPONSES_NAMES,
            model=fields["model"],
            sampling=Sampling(max_tokens=fields.get("max_output_tokens"), structured_outputs=constraint_, **sampling),
            stream=fields.get("stream", False),
            salience=fields.get("salience"),
            tools=tools,
            tool_choice=choice,
            parallel_tool_calls=parallel,
        ),
        instructions=fields.get("instructions"),
        input=messages,
        outputs=outputs,
        store=fields.get("store", True),  # OpenAI's default
        previous_response_id=fields.get("previous_response_id"),
        echo={
            "instructions": fields.get("instructions"),
            "max_output_tokens": fields.get("max_output_tokens"),
            "temperature": fields.get("temperature", 1.0),
            "top_p": fields.get("top_p", 1.0),
            "previous_response_id": fields.get("previous_response_id"),
            "store": fields.get("store", True),
            "text": {"format": (data.get("text") or {}).get("format") or {"type": "text"}},
            "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice") or choice.mode,
            "parallel_tool_calls": parallel,
            "metadata": data.get("metadata") or {},
            "user": data.get("user"),
        },
    )
