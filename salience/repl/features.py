"""The REPL's `/features [K] [SAE]`: which SAE's top features to ask for, and how they print.

Kept out of console.py so the connection loop stays short; nothing here talks to the server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["DEFAULT_K", "FeatureView", "choose_features", "feature_lines"]

DEFAULT_K = 5
EVERY_POSITION = [[0, 2**31]]  # the prompt's and the generated ones


@dataclass(frozen=True)
class FeatureView:
    """The top `k` features of SAE `sae` (read at `layer`) on every token of each request."""

    sae: str
    layer: int
    k: int

    def field(self) -> dict:
        """The request's `features` field."""
        return {"sae": self.sae, "k": self.k, "ranges": EVERY_POSITION}

    def header(self) -> str:
        return f"top {self.k} features of SAE {self.sae} at layer {self.layer}"


def choose_features(arg: str, saes: list[dict]) -> FeatureView:
    """`[K] [SAE]` against MODEL_INFO's `saes`; ValueError says what is wrong. K defaults to 5
    (fewer where the SAE keeps fewer), SAE to the first one served."""
    if not saes:
        raise ValueError("the server serves no SAE: start it with --sae [NAME=]DIR to read features")
    words = arg.split()
    if len(words) > 2 or (words and not words[0].isdigit()):
        raise ValueError("usage: /features [K] [SAE]   or   /features off")
    by_name = {sae["name"]: sae for sae in saes}
    name = words[1] if len(words) == 2 else saes[0]["name"]
    if name not in by_name:
        raise ValueError(f"unknown SAE {name!r}; this server serves {', '.join(by_name)}")
    sae = by_name[name]
    k = int(words[0]) if words else min(DEFAULT_K, sae["top"])
    if not 1 <= k <= sae["top"]:
        raise ValueError(f"K must be 1 to {sae['top']} for SAE {name} (the most it keeps per token)")
    return FeatureView(sae=name, layer=sae["layer"], k=k)


def feature_lines(rows: list[dict], texts: list[str]) -> list[str]:
    """One line per token: its text, then `#id:activation` of each active feature, largest first."""
    shown = [json.dumps(text, ensure_ascii=False) for text in texts]
    width = max(map(len, shown), default=0)
    lines = []
    for payload, token in zip(rows, shown, strict=True):
        pairs = " ".join(f"#{feature}:{activation:.2f}" for feature, activation in payload["features"])
        lines.append(f"  {token:<{width}}  {pairs or '(none active)'}")
    return lines
