"""What an eval log keeps of a reply's `salience` object: the figures a person or a scorer reads.

A response's per-token entries (a row of `len(layers) * len(concepts)` floats per token, SAE
features, monitor events) are what makes it large: a 200-token reply read at three layers is
thousands of numbers written out as JSON text, and Inspect logs every model call's response.
So the log keeps the reply's summary, the monitors that fired, the steering sent and the
features' top ids, and keeps per-token rows only when asked (`token_arrays`), packed as
little-endian float32 in base64 (four bytes a value, a third of their JSON text). The logged
model call loses its per-token entries in the same way: what it kept lives here.
"""

from __future__ import annotations

import base64
import sys
from array import array
from typing import Any

__all__ = ["pack_rows", "reply_readings", "strip_token_entries", "unpack_rows"]

_PER_TOKEN = ("tokens", "prompt")  # a choice's per-token lists, in the response's `salience` object
_TOP_FEATURES = 16  # ids kept in `features.top`: the reply's most active


def reply_readings(response: dict[str, Any], request: dict[str, Any], *, token_arrays: bool) -> dict[str, Any]:
    """`ModelOutput.metadata["salience"]` for a response to a request with the extension `request`."""
    choices = response.get("choices") or [{}]
    extension = choices[0].get("salience") or {}
    tokens = extension.get("tokens") or []
    readings: dict[str, Any] = {}
    if "salience" in response:  # the layout of a readout row: layers, concepts and format
        readings["layout"] = response["salience"]
    for key in ("summary", "fields", "stopped_by"):
        if key in extension:
            readings[key] = extension[key]
    fired = [{"index": i, **event} for i, token in enumerate(tokens) for event in token.get("monitors", ())]
    if fired or request.get("monitors"):
        readings["monitors"] = fired
    if request.get("steer"):
        readings["steer"] = request["steer"]
    if any("features" in token for token in tokens):
        readings["features"] = {"top": _top_features(tokens)}
    if token_arrays:
        for key in _PER_TOKEN:
            if extension.get(key):
                readings[key] = _token_arrays(extension[key])
    return readings


def strip_token_entries(response: dict[str, Any]) -> None:
    """Drop each choice's per-token entries from a logged response, keeping their count."""
    for choice in response.get("choices") or ():
        extension = choice.get("salience")
        for key in _PER_TOKEN:
            if isinstance(extension, dict) and key in extension:
                extension[key] = f"{len(extension[key])} entries, dropped from the log (metadata.salience)"


def _top_features(tokens: list[dict[str, Any]]) -> list[list[float]]:
    """The features active on the reply as `[id, largest activation, tokens active on]`, most active first."""
    largest: dict[int, float] = {}
    count: dict[int, int] = {}
    for token in tokens:
        for feature, activation in token.get("features", ()):
            largest[feature] = max(activation, largest.get(feature, activation))
            count[feature] = count.get(feature, 0) + 1
    ranked = sorted(largest, key=lambda f: (-largest[f], f))[:_TOP_FEATURES]
    return [[feature, largest[feature], count[feature]] for feature in ranked]


def _token_arrays(entries: list[dict[str, Any]]) -> dict[str, Any]:
    arrays: dict[str, Any] = {"positions": [entry["position"] for entry in entries]}
    rows = [entry["readout"] for entry in entries if "readout" in entry]
    if rows:
        arrays["readout"] = pack_rows(rows)
    if any("features" in entry for entry in entries):
        arrays["features"] = [entry.get("features", []) for entry in entries]
    return arrays


def pack_rows(rows: list[list[float]]) -> dict[str, Any]:
    """Equal-length rows as `{"shape": [n, width], "f32": base64 of little-endian float32}`."""
    values = array("f", [value for row in rows for value in row])
    if sys.byteorder != "little":
        values.byteswap()
    return {"shape": [len(rows), len(rows[0])], "f32": base64.b64encode(values.tobytes()).decode("ascii")}


def unpack_rows(packed: dict[str, Any]) -> list[list[float]]:
    """pack_rows's rows back (as float32 rounds them)."""
    values = array("f", base64.b64decode(packed["f32"]))
    if sys.byteorder != "little":
        values.byteswap()
    n, width = packed["shape"]
    return [values[i * width : (i + 1) * width].tolist() for i in range(n)]
