"""Function tools and the choice among them, sans I/O: the request side of tool calling.

A `Tool` is a function the model may call: a name, a description, and the JSON schema of its
arguments. `ToolChoice` is OpenAI's `tool_choice`: `none` (no call), `auto` (the model decides,
and its text is parsed for calls by a parser for its family, tool_calls.py), `required` (at
least one call) or a named function (exactly that one). The last two are enforced by
constrained decoding, so any model returns a valid call: the reply is constrained to the JSON
schema `forced_call` builds, in vLLM's shapes (its `get_json_schema_from_tools`): a named
function's reply is its arguments object; `required`'s is an array of `{"name", "parameters"}`.

Chat's spelling (`{"type": "function", "function": {...}}`) is read here; the Responses API
spells a tool flat (`{"type": "function", "name", ...}`), and reads it with `parse_function`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from salience.core.engine.constraints import MAX_SPEC_CHARS
from salience.core.engine.requests import Constraint
from salience.openai.errors import bad_request

__all__ = [
    "AUTO",
    "NONE",
    "REQUIRED",
    "Tool",
    "ToolChoice",
    "check_choice",
    "forced_call",
    "parse_function",
    "parse_tool_choice",
    "parse_tools",
]

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function's name, as OpenAI allows
MAX_TOOLS = 128  # OpenAI's bound
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


@dataclass(frozen=True, kw_only=True)
class Tool:
    """A function the model may call. `parameters`: the JSON schema of its arguments (an object
    schema; `{"type": "object", "properties": {}}` when the request gave none)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any]
    strict: bool = False

    def as_json(self) -> dict:
        """OpenAI's chat form, as chat templates (transformers' `tools=`) and vLLM's parsers read it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """`mode` none, auto, required, or function (then `name` is the function's)."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the reply must be a call (enforced by constrained decoding)."""
        return self.mode in ("required", "function")


NONE, AUTO, REQUIRED = ToolChoice("none"), ToolChoice("auto"), ToolChoice("required")


def parse_tools(value: Any, name: str = "tools", *, flat: bool = False) -> tuple[Tool, ...]:
    """Chat's `tools`: `[{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}, ...]`, names unique; `flat`: the Responses API's spelling, the function's fields
    beside `type`."""
    if not isinstance(value, list):
        raise bad_request(f"{name} must be a list of tools", name)
    if len(value) > MAX_TOOLS:
        raise bad_request(f"{name} holds {len(value)} tools; at most {MAX_TOOLS} are allowed", name)
    tools = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            raise bad_request(f'{where}.type must be "function": this server calls functions only', f"{where}.type")
        if flat:
            tools.append(parse_function(item, where, allowed=("type",)))
            continue
        if extra := sorted(set(item) - {"type", "function"}):
            raise bad_request(f"{where}.{extra[0]} is not a field of a function tool", f"{where}.{extra[0]}")
        tools.append(parse_function(item.get("function"), f"{where}.function"))
    _unique(tools, name)
    return tuple(tools)


def parse_function(value: Any, where: str, *, allowed: Sequence[str] = ()) -> Tool:
    """A function's definition: `{"name", "description"?, "parameters"?, "strict"?}` (and the
    `allowed` fields besides, which the caller reads: the Responses API's `type`)."""
    if not isinstance(value, dict):
        raise bad_request(f'{where} must be {{"name", "description"?, "parameters"?, "strict"?}}', where)
    if extra := sorted(set(value) - {*_FUNCTION_FIELDS, *allowed}):
        raise bad_request(f"{where}.{extra[0]} is not a field of a function", f"{where}.{extra[0]}")
    name = value.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{where}.name")
    description, strict = value.get("description"), value.get("strict")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    if strict is not None and type(strict) is not bool:
        raise bad_request(f"{where}.strict must be true or false", f"{where}.strict")
    parameters = value.get("parameters")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    _check_schema(parameters, f"{where}.parameters")
    return Tool(name=name, description=description, parameters=parameters, strict=bool(strict))


def _check_schema(schema: Any, where: str) -> None:
    """A JSON schema (by its meta-schema) for an object: the arguments are a JSON object."""
    from jsonschema import Draft202012Validator, SchemaError

    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema (an object)", where)
    if schema.get("type", "object") != "object":
        raise bad_request(f'{where} must describe an object (type "object"): arguments are named', where)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise bad_request(f"{where}{at} is not a valid JSON schema: {exc.message}", where) from None
    if len(json.dumps(schema)) > MAX_SPEC_CHARS:
        raise bad_request(f"{where} is longer than {MAX_SPEC_CHARS} characters of JSON", where)


def _unique(tools: Sequence[Tool], name: str) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.name in seen:
            raise bad_request(f"{name}[{i}] names {tool.name!r} again: function names must be unique", name)
        seen.add(tool.name)


def parse_tool_choice(value: Any, tools: Sequence[Tool], name: str = "tool_choice") -> ToolChoice:
    """Chat's `tool_choice`: "none", "auto", "required", or `{"type": "function", "function":
    {"name"}}` naming one of `tools`."""
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    else:
        function = value.get("function") if isinstance(value, dict) else None
        if (
            not isinstance(function, dict)
            or value.get("type") != "function"
            or set(value) != {"type", "function"}
            or set(function) != {"name"}
        ):
            raise bad_request(
                f'{name} must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}',
                name,
            )
        choice = ToolChoice("function", function["name"])
    check_choice(choice, tools, name)
    return choice


def check_choice(choice: ToolChoice, tools: Sequence[Tool], name: str = "tool_choice") -> None:
    """A choice that calls needs tools, and a named function must be one of them."""
    if choice.mode != "none" and not tools:
        raise bad_request(f"{name} is only allowed when tools are given", name)
    if choice.mode == "function" and choice.name not in {tool.name for tool in tools}:
        raise bad_request(f"{name} names the function {choice.name!r}, which is not in tools", name)


def forced_call(
    tools: Sequence[Tool], choice: ToolChoice, *, parallel: bool = True, name: str = "tools", flat: bool = False
) -> Constraint:
    """The JSON-schema constraint a forced choice decodes under (vLLM's shapes): a named
    function's arguments, or for `required` an array of calls `[{"name", "parameters"}, ...]`
    (one at most unless `parallel`). `name`: the request's field holding the tools; `flat`: they
    are spelled flat, as the Responses API's (`tools[1].parameters`, not chat's
    `tools[1].function.parameters`), for errors naming a function's schema."""
    if choice.mode == "function":
        i, tool = next((i, t) for i, t in enumerate(tools) if t.name == choice.name)
        return _constraint(dict(tool.parameters), f"{name}[{i}].{'' if flat else 'function.'}parameters")
    if choice.mode != "required":
        raise ValueError(f"tool_choice {choice.mode} forces no call")
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        parameters = dict(tool.parameters)
        for key, schema in parameters.pop("$defs", {}).items():  # one $defs at the root, as vLLM
            if defs.setdefault(key, schema) != schema:
                raise bad_request(f"two tools define $defs.{key} differently; give them one definition", name)
        calls.append(
            {
                "properties": {"name": {"type": "string", "enum": [tool.name]}, "parameters": parameters},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return _constraint(schema, name)


def _constraint(schema: dict, source: str) -> Constraint:
    return Constraint(kind="json", spec=json.dumps(schema, ensure_ascii=False, separators=(",", ":")), source=source)
