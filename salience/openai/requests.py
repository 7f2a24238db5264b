"""OpenAI requests, sans I/O: a JSON body in, a typed `ApiRequest` out, or an ApiError naming the field.

Both endpoints read the same sampling fields into one dataclass, so the code that runs them
does not care which one it serves. What is checked here is OpenAI's contract (types, and the
ranges OpenAI documents: temperature 0..2, penalties -2..2, logit_bias -100..100, at most 4 stop
strings, n 1..128); what depends on the model (vocabulary, context, --max-logprobs) is the core
engine's check, run by `run.py` under the name of the field it is about.

Fields are OpenAI's contract, plus the extras vLLM's server takes (`top_k`, `min_p`,
`structured_outputs`, ..., spelled as vLLM spells them), not a superset: an unknown top-level
field is a 400 ("Unrecognized request argument supplied"), as OpenAI's own server answers, never
silently ignored. Fields that do not change the output (`user`, `metadata`, `store`, ...) are
accepted and ignored; fields asking for what this server does not do (`functions`, `echo`, ...)
are a 400 naming them, unless they carry their neutral value (`functions: []`, `echo: false`).

Chat's `tools` and `tool_choice` are read by tools.py; a forced choice (`required`, a named
function) becomes the request's constraint, so it cannot be sent with another one.

`response_format` and `structured_outputs` become one core Constraint, read by core's reader
(core/engine/constraints.py, LMTP's too); the engine checks it against its backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from salience.core.engine.chat_messages import ChatMessage, check_tool_replies, parse_messages
from salience.core.engine.constraints import constraint, parse_constraint
from salience.core.engine.requests import Constraint
from salience.openai.errors import bad_request, naming
from salience.openai.extension import Extension, parse_extension
from salience.openai.fields import INT64, Reader, boolean, finite, integer, load, number, read_fields, show, string
from salience.openai.tools import AUTO, NONE, Tool, ToolChoice, forced_call, parse_tool_choice, parse_tools

__all__ = ["CHAT", "COMPLETION", "ApiRequest", "Sampling", "parse_chat", "parse_completion", "schema_format"]

CHAT, COMPLETION = "chat_completion", "completion"  # the endpoints, as metrics name their streams
MAX_STOP = 4  # stop strings, as OpenAI allows
MAX_N = 128
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, OpenAI's bound (the server's --max-logprobs may be lower)
MAX_COMPLETION_LOGPROBS = 5  # the completions endpoint's integer logprobs, OpenAI's bound
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # response_format.json_schema.name, as OpenAI allows


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How every choice of a request decodes; choice i of n>1 with a seed uses seed + i (as vLLM)."""

    max_tokens: int | None = None  # None: chat, up to the context; completions default to 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False  # the matched stop string (or stop token's text) is kept
    skip_special_tokens: bool = True  # special tokens add no text
    structured_outputs: Constraint | None = None  # from response_format or structured_outputs


@dataclass(frozen=True, kw_only=True)
class ApiRequest:
    """One request to either endpoint. `prompts`: the completions endpoint's (each a text or token
    ids; a list of them is a batch, n choices each); `messages`: chat's."""

    kind: str  # CHAT or COMPLETION
    model: str
    messages: tuple[ChatMessage, ...] = ()
    prompts: tuple[str | tuple[int, ...], ...] = ()
    sampling: Sampling = field(default_factory=Sampling)
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    salience: Extension | None = None
    tools: tuple[Tool, ...] = ()  # chat's functions the model may call
    tool_choice: ToolChoice = NONE  # auto when tools are given
    parallel_tool_calls: bool = True
    # Core's field names this request's wire spells otherwise, for an error's param (run.py).
    names: Mapping[str, str] = field(default_factory=dict)


# Core's names that chat calls otherwise: the prompt is the rendering of its messages.
CHAT_NAMES = MappingProxyType({"prompt": "messages", "logprobs": "top_logprobs"})

# ---- readers: value and field name in, typed value out, or a 400 naming the field ------------


def _stop(value: Any, name: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request(f"{name} must be a non-empty string or a list of them", name)
    if len(stops) > MAX_STOP:
        raise bad_request(f"{name} holds {len(stops)} strings; at most {MAX_STOP} are allowed", name)
    return tuple(stops)


def _logit_bias(value: Any, name: str) -> Mapping[int, float]:
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object of token id -> bias, got {show(value)}", name)
    bias = {}
    for key, amount in value.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= INT64:
            raise bad_request(f"{name} key {key!r} is not a token id", name)
        bias[int(key)] = number(-100, 100)(amount, f"{name}[{key}]")
    return MappingProxyType(bias)


def _stream_options(value: Any, name: str) -> bool:
    """Whether the stream ends with a usage chunk. `include_obfuscation` is accepted and has no
    effect: this server pads nothing."""
    if not isinstance(value, dict) or set(value) - {"include_usage", "include_obfuscation"}:
        raise bad_request(f'{name} must be {{"include_usage": bool, "include_obfuscation": bool}}', name)
    for key, flag in value.items():
        if flag is not None:
            boolean(flag, f"{name}.{key}")
    return bool(value.get("include_usage"))


def _prompts(value: Any, name: str) -> tuple[str | tuple[int, ...], ...]:
    """A text, a list of texts, token ids, or a list of token-id lists (OpenAI's four forms)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return (_token_ids(value, name),)
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        return tuple(_token_ids(p, f"{name}[{i}]") for i, p in enumerate(value))
    raise bad_request(f"{name} must be a text, a list of texts, token ids, or a list of token-id lists", name)


def _token_ids(value: list, name: str) -> tuple[int, ...]:
    if not value or not all(type(t) is int and 0 <= t < INT64 for t in value):
        raise bad_request(f"{name} must be a non-empty list of token ids (integers >= 0)", name)
    return tuple(value)


def _messages(value: Any, name: str) -> tuple[ChatMessage, ...]:
    with naming(name):  # core's one reader of messages, whichever wire they came on
        messages = parse_messages(value, name)
        check_tool_replies(messages, name)
        return messages


def _extension(value: Any, name: str) -> Extension:
    return parse_extension(value, name)


def _token_id_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t < INT64 for t in value):
        raise bad_request(f"{name} must be a list of token ids (integers >= 0)", name)
    return tuple(value)


def _structured_outputs(value: Any, name: str) -> Constraint:
    with naming(name):  # core's one reader, LMTP's too
        return parse_constraint(value, name)


def _response_format(value: Any, name: str) -> Constraint | None:
    """OpenAI's response_format: `text` (no constraint), `json_object` or `json_schema`."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad_request(f'{name}.type must be "text", "json_object" or "json_schema"', f"{name}.type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if extra := sorted(set(value) - allowed):
        raise bad_request(f"{name}.{extra[0]} is not a field of a {kind} response_format", f"{name}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return constraint("json_object", True, name)
    spec, where = value.get("json_schema"), f"{name}.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f'{where} must be {{"name", "schema", "strict"?, "description"?}}', where)
    if extra := sorted(set(spec) - {"name", "schema", "strict", "description"}):
        raise bad_request(f"{where}.{extra[0]} is not a field of json_schema", f"{where}.{extra[0]}")
    return schema_format(spec, where)


def schema_format(spec: dict, where: str) -> Constraint:
    """A json_schema format's `name`, `strict`, `description` and `schema` as the constraint: chat
    nests them under `response_format.json_schema`, the Responses API puts them in `text.format`."""
    if not isinstance(spec.get("name"), str) or not SCHEMA_NAME.fullmatch(spec["name"]):
        raise bad_request(f"{where}.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{where}.name")
    for key, check in (("strict", boolean), ("description", string)):
        if spec.get(key) is not None:
            check(spec[key], f"{where}.{key}")
    if spec.get("schema") is None:
        raise bad_request(f"{where}.schema is required: the JSON schema the output follows", f"{where}.schema")
    with naming(f"{where}.schema"):
        return constraint("json", spec["schema"], f"{where}.schema")


_SAMPLING: dict[str, Reader] = {
    "model": string,
    "temperature": number(0, 2),
    "top_p": number(0, 1),
    "seed": integer(-INT64, INT64 - 1),
    "stop": _stop,
    "n": integer(1, MAX_N),
    "logit_bias": _logit_bias,
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "stream": boolean,
    "stream_options": _stream_options,
    "salience": _extension,
    "response_format": _response_format,
    # vLLM's extras, as its server spells them
    "structured_outputs": _structured_outputs,
    "top_k": integer(-1, INT64 - 1),  # -1 and 0: off
    "min_p": number(0, 1),
    "repetition_penalty": finite,
    "min_tokens": integer(0, INT64 - 1),
    "ignore_eos": boolean,
    "stop_token_ids": _token_id_list,
    "include_stop_str_in_output": boolean,
    "skip_special_tokens": boolean,
}
_CHAT: dict[str, Reader] = {
    **_SAMPLING,
    "messages": _messages,
    "max_tokens": integer(1, INT64 - 1),
    "max_completion_tokens": integer(1, INT64 - 1),
    "logprobs": boolean,
    "top_logprobs": integer(0, MAX_TOP_LOGPROBS),
    "tools": parse_tools,
    "tool_choice": lambda value, name: value,  # read with the tools it names (parse_chat)
    "parallel_tool_calls": boolean,
}
_COMPLETION: dict[str, Reader] = {
    **_SAMPLING,
    "prompt": _prompts,
    "max_tokens": integer(1, INT64 - 1),
    "logprobs": integer(0, MAX_COMPLETION_LOGPROBS),
}
# Accepted, with no effect on what is generated.
_IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"}
)
# OpenAI's, asking for what this server does not do: refused unless neutral (the SDKs and LangChain
# send some of these with their neutral value).
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v == [],  # OpenAI's deprecated spelling of tools
    "function_call": lambda v: v == "none",
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "reasoning_effort": lambda v: False,
    "verbosity": lambda v: False,
    "moderation": lambda v: False,
    "prompt_cache_options": lambda v: False,
}
_NEUTRAL_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
}


def _sampling(fields: dict[str, Any], max_tokens: int | None) -> Sampling:
    n, seed = fields.get("n", 1), fields.get("seed")
    if seed is not None and seed + n - 1 >= INT64:  # choice i decodes with seed + i
        raise bad_request(f"seed must be below 2**63 - {n - 1} with n = {n}", "seed")
    names = (
        "temperature",
        "top_p",
        "stop",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
    )
    formatted, constrained = fields.get("response_format"), fields.get("structured_outputs")
    if formatted is not None and constrained is not None:
        raise bad_request(
            "response_format and structured_outputs both constrain the output; send one of them", "structured_outputs"
        )
    return Sampling(
        max_tokens=max_tokens,
        n=n,
        seed=seed,
        top_k=max(fields.get("top_k", 0), 0),
        structured_outputs=formatted or constrained,
        **{k: fields[k] for k in names if k in fields},
    )


def _streaming(fields: dict[str, Any]) -> dict[str, Any]:
    stream = fields.get("stream", False)
    if "stream_options" in fields and not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    return {"stream": stream, "include_usage": fields.get("stream_options", False)}


def parse_chat(body: bytes) -> ApiRequest:
    """A `POST /v1/chat/completions` body."""
    fields = read_fields(load(body), _CHAT, _IGNORED, _NEUTRAL)
    if "messages" not in fields:
        raise bad_request("messages is required", "messages")
    if "top_logprobs" in fields and not fields.get("logprobs"):
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    tools = fields.get("tools", ())
    choice = parse_tool_choice(fields["tool_choice"], tools) if "tool_choice" in fields else AUTO if tools else NONE
    parallel = fields.get("parallel_tool_calls", True)
    sampling = _sampling(fields, fields.get("max_completion_tokens", fields.get("max_tokens")))
    if choice.forced:
        if sampling.structured_outputs is not None:
            raise bad_request(
                f"tool_choice {choice.name or choice.mode!r} forces a call, and {sampling.structured_outputs.source} "
                "constrains the reply too; send one of them",
                "tool_choice",
            )
        sampling = replace(sampling, structured_outputs=forced_call(tools, choice, parallel=parallel))
    return ApiRequest(
        kind=CHAT,
        names=CHAT_NAMES,
        model=fields["model"],
        messages=fields["messages"],
        sampling=sampling,
        logprobs=fields.get("logprobs", False),
        top_logprobs=fields.get("top_logprobs", 0),
        salience=fields.get("salience"),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        **_streaming(fields),
    )


def parse_completion(body: bytes) -> ApiRequest:
    """A `POST /v1/completions` body."""
    fields = read_fields(load(body), _COMPLETION, _IGNORED, _NEUTRAL_COMPLETION)
    if "prompt" not in fields:
        raise bad_request("prompt is required", "prompt")
    return ApiRequest(
        kind=COMPLETION,
        model=fields["model"],
        prompts=fields["prompt"],
        sampling=_sampling(fields, fields.get("max_tokens", 16)),
        logprobs="logprobs" in fields,
        top_logprobs=fields.get("logprobs", 0),
        salience=fields.get("salience"),
        **_streaming(fields),
    )
