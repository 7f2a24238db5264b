"""The REPL's command arguments as LMTP fields: pure parsing, no connection."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["is_number", "parse_line", "parse_monitor", "parse_steer"]


def parse_line(line: str) -> tuple[str, dict[str, Any]]:
    """Split 'prompt words key=value ...' into the prompt and the parameters."""
    words = line.split(" ")
    params: dict[str, Any] = {}
    while words and "=" in words[-1] and not words[-1].startswith("="):
        key, _, raw = words.pop().partition("=")
        try:
            params[key] = json.loads(raw)
        except ValueError:
            params[key] = raw
    return " ".join(words), dict(reversed(params.items()))


def parse_steer(args: str, layers_of: dict[str, list[int]]) -> dict:
    """`NAME +A|-A|=V|ablate [LAYERS] [@all|@prompt|@generated]` as an intervention's LMTP form.
    `layers_of` is each direction's layers (MODEL_INFO's steering.directions)."""
    words = args.split()
    if len(words) < 2:
        raise ValueError("usage: /steer NAME +A|-A|=V|ablate [LAYERS] [@all|@prompt|@generated]")
    name, amount, *rest = words
    if name not in layers_of:
        raise ValueError(f"unknown direction {name!r}; this server steers along {', '.join(layers_of)}")
    intervention: dict[str, Any] = {"direction": name, "positions": "all"}
    if amount == "ablate":
        intervention["op"] = "ablate"
    elif amount[:1] in "+-=" and is_number(amount[1:]):
        intervention["op"] = "set" if amount[0] == "=" else "add"
        intervention["value"] = float(amount[1:]) * (-1 if amount[0] == "-" else 1)
    else:
        raise ValueError(f"{amount!r} is not +A, -A, =V or ablate")
    available = layers_of[name]
    intervention["layers"] = [available[len(available) // 2]]
    for word in rest:
        if word.startswith("@"):
            if word[1:] not in ("all", "prompt", "generated"):
                raise ValueError(f"{word!r} is not @all, @prompt or @generated")
            intervention["positions"] = word[1:]
        elif "-" in word:
            first, _, last = word.partition("-")
            if not (first.isdigit() and last.isdigit()):
                raise ValueError(f"{word!r} is not a layer range like 10-14")
            intervention["layers"] = list(range(int(first), int(last) + 1))
        elif all(part.isdigit() for part in word.split(",")):
            intervention["layers"] = [int(part) for part in word.split(",")]
        else:
            raise ValueError(f"{word!r} is not LAYERS or @positions")
    return intervention


def parse_monitor(args: str) -> dict:
    """`NAME >P|<P stop|flag [LAYER]` as a monitor's LMTP form (the server checks the rest)."""
    words = args.split()
    if len(words) not in (3, 4) or words[1][:1] not in "<>" or not is_number(words[1][1:]):
        raise ValueError("usage: /monitor NAME >P|<P stop|flag [LAYER]   (e.g. /monitor code >0.9 stop)")
    name, threshold, action, *layer = words
    monitor: dict[str, Any] = {"concept": name, "above" if threshold[0] == ">" else "below": float(threshold[1:])}
    monitor["action"] = action
    if layer:
        if not layer[0].isdigit():
            raise ValueError(f"{layer[0]!r} is not a layer number")
        monitor["layer"] = int(layer[0])
    return monitor


def is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
