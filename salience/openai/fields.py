"""The JSON field readers of OpenAI request bodies (chat, completions and Responses): a value and
its field's name in, a typed value out, or a 400 naming the field as OpenAI's `param`.

`read_fields` applies OpenAI's rule for a whole body once for every endpoint: known fields read,
null ones left at their default, harmless ones ignored, and any other field a 400: unknown, or
asking for what this server does not do unless it carries its neutral value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from salience.openai.errors import bad_request

__all__ = ["INT64", "Reader", "boolean", "finite", "integer", "load", "number", "read_fields", "show", "string"]

INT64 = 2**63
Reader = Callable[[Any, str], Any]


def show(value: Any) -> str:
    """A value as an error quotes it, cut short."""
    text = orjson.dumps(value).decode() if isinstance(value, (dict, list, str, int, float, bool)) else "?"
    return text if len(text) <= 40 else text[:37] + "..."


def number(low: float, high: float) -> Reader:
    def read(value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"{name} must be a number, got {show(value)}", name)
        if not low <= value <= high:
            raise bad_request(f"{name} must be in [{low:g}, {high:g}], got {value}", name)
        return float(value)

    return read


def integer(low: int, high: int) -> Reader:
    def read(value: Any, name: str) -> int:
        if type(value) is not int:
            raise bad_request(f"{name} must be an integer, got {show(value)}", name)
        if not low <= value <= high:
            raise bad_request(f"{name} must be in [{low}, {high}], got {value}", name)
        return value

    return read


def boolean(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise bad_request(f"{name} must be true or false, got {show(value)}", name)
    return value


def string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string, got {show(value)}", name)
    return value


def finite(value: Any, name: str) -> float:
    """A number whose range the core checks (vLLM's extras have vLLM's ranges)."""
    return number(-math.inf, math.inf)(value, name)


def load(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc})") from None


def read_fields(
    data: Any, readers: Mapping[str, Reader], ignored: Collection[str], neutral: Mapping[str, Callable[[Any], bool]]
) -> dict[str, Any]:
    """The body's known fields read, null ones left out (null means the default, as in OpenAI's API)."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    for name, value in data.items():
        if name in readers or name in ignored or value is None:
            continue
        if name not in neutral:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
        if not neutral[name](value):
            raise bad_request(f"{name} is not supported by this server", name)
    if data.get("model") is None:
        raise bad_request("you must provide a model parameter", "model")
    return {name: readers[name](value, name) for name, value in data.items() if name in readers and value is not None}
