"""The JSON field readers every wire uses: LMTP's messages and the OpenAI API's bodies (gRPC's
fields are typed by protobuf) read integers, numbers, booleans and strings here.

Each reader takes the JSON value and the field's name and returns the typed value, or raises
InvalidArgument whose `field` is that name, so each wire reports the field its own way (LMTP's
`field`, OpenAI's `param`) without reading it out of the message. A bound broken is worded as
LMTP has always worded it (`max_tokens must be >= 1`) or as the OpenAI API does (`n must be
in [1, 128]`: an integer's `interval`, and any number's bounds, which only OpenAI's fields have),
so neither wire's messages change.

Not `json_fields`: core/probes/json_fields.py is about the fields of a JSON *reply* (monitors
that watch one), not a request's.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from salience.errors import InvalidArgument

__all__ = ["INT64", "boolean", "integer", "number", "show", "string"]

INT64 = 2**63  # JSON's integers are unbounded; every wire's are int64


def show(value: Any) -> str:
    """A value as an error quotes it, cut short."""
    text = orjson.dumps(value).decode() if isinstance(value, (dict, list, str, int, float, bool, type(None))) else "?"
    return text if len(text) <= 40 else text[:37] + "..."


def integer(value: Any, name: str, low: int | None = None, high: int | None = None, *, interval: bool = False) -> int:
    """An integer in [low, high], and in int64 unless `interval` (whose bounds, both given, say it)."""
    if type(value) is not int:
        raise InvalidArgument(f"{name} must be an integer, got {show(value)}", field=name)
    if interval:
        _within(value, name, -INT64 if low is None else low, INT64 - 1 if high is None else high)
        return value
    if not -INT64 <= value < INT64:
        raise InvalidArgument(f"{name} is out of range: {value}", field=name)
    if low is not None and value < low:
        raise InvalidArgument(f"{name} must be >= {low}, got {value}", field=name)
    if high is not None and value > high:
        raise InvalidArgument(f"{name} must be <= {high}, got {value}", field=name)
    return value


def number(value: Any, name: str, low: float = -math.inf, high: float = math.inf) -> float:
    """A finite number (an integer too) in [low, high]; only the OpenAI API bounds one, in its wording."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{name} must be a number, got {show(value)}", field=name)
    if not math.isfinite(value):
        raise InvalidArgument(f"{name} must be finite, got {value}", field=name)
    _within(value, name, low, high)
    return float(value)


def _within(value: float, name: str, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidArgument(f"{name} must be in [{low}, {high}], got {value}", field=name)


def boolean(value: Any, name: str) -> bool:
    if type(value) is not bool:
        raise InvalidArgument(f"{name} must be true or false, got {show(value)}", field=name)
    return value


def string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {show(value)}", field=name)
    return value
