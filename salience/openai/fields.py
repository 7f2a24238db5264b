"""The JSON field readers of OpenAI request bodies (chat, completions and Responses): a value and
its field's name in, a typed value out, or a 400 naming the field as OpenAI's `param`. The
readers are salience.readers' (LMTP's too), their InvalidArgument's field made the param.

`read_fields` applies OpenAI's rule for a whole body once for every endpoint: known fields read,
null ones left at their default, harmless ones ignored, and any other field a 400: unknown, or
asking for what this server does not do unless it carries its neutral value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from salience import readers
from salience.openai.errors import bad_request, naming
from salience.readers import INT64, show

__all__ = ["INT64", "Reader", "boolean", "finite", "integer", "load", "number", "read_fields", "show", "string"]

Reader = Callable[[Any, str], Any]


def _api(read: Reader) -> Reader:
    """One of salience.readers, its error the 400 whose param is its field."""

    def api_read(value: Any, name: str) -> Any:
        with naming(name):
            return read(value, name)

    return api_read


def number(low: float, high: float) -> Reader:
    return _api(lambda value, name: readers.number(value, name, low, high))


def integer(low: int, high: int) -> Reader:
    return _api(lambda value, name: readers.integer(value, name, low, high, interval=True))


boolean = _api(readers.boolean)
string = _api(readers.string)
finite = number(-math.inf, math.inf)  # a number whose range the core checks (vLLM's extras have vLLM's ranges)


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
