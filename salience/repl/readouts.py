"""The REPL's `/readout` view: which value of a readout row each concept shows, and how rows print.

Kept out of console.py so the connection loop stays short; nothing here talks to the server, so the
table and chat mode's per-concept summary are tested without one. A readout row is flat and
layer-major (`len(layers) * len(concepts)` values, docs/lmtp.md), so a concept's value at a layer
is one column of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReadoutView", "choose_readout", "concept_facts", "readout_summary", "readout_table"]


NOT_READ = "-"
WHY_NOT_READ = (
    f"{NOT_READ}: position 0 is not read as a probability (the first token holds every model's "
    "attention-sink activations, which say nothing about the text; running means leave it out)"
)
MODES = {
    "running": "p that the text so far has the concept",
    "token": "p that this token belongs to a text with the concept",
}


@dataclass(frozen=True)
class ReadoutView:
    """What `/readout` shows: a probability view, "running" or "token" (each concept at its
    recommended layer, 0.00-1.00; readout_format of the same name), or "raw" (every concept's
    projection at `layer`)."""

    mode: str
    layer: int | None = None

    @property
    def probability(self) -> bool:
        return self.mode in MODES

    def columns(self, manifest: dict) -> list[int]:
        """Each concept's column in a row, in the order of the manifest's concepts."""
        concepts, layers = manifest["concepts"], manifest["layers"]
        if self.probability:
            return [
                layers.index(info["recommended_layer"]) * len(concepts) + k
                for k, info in enumerate(manifest["concept_info"])
            ]
        return [layers.index(self.layer) * len(concepts) + k for k in range(len(concepts))]

    def number(self, value: float) -> str:
        if math.isnan(value):
            return NOT_READ
        return f"{value:.2f}" if self.probability else f"{value:.4g}"

    def header(self, manifest: dict) -> str:
        """What `/readout` answers: the concepts and where each is read."""
        if self.probability:
            layers = ", ".join(f"{i['name']}@{i['recommended_layer']}" for i in manifest["concept_info"])
            return f"concept probabilities ({self.mode}: {MODES[self.mode]}), each at its recommended layer: {layers}"
        return f"raw readouts at layer {self.layer} of {', '.join(manifest['concepts'])}"


def choose_readout(arg: str, manifest: dict | None) -> ReadoutView:
    """`/readout [running|token|raw [LAYER]]` against MODEL_INFO's readout manifest; ValueError says
    what is wrong. Probabilities need a calibrated set (running is the default); raw readouts
    default to the deepest layer read."""
    if not manifest:
        raise ValueError("the server has no concept set: it reads nothing out")
    mode, _, layer_arg = arg.partition(" ")
    layer_arg = layer_arg.strip()
    if mode in ("", *MODES) and not layer_arg:
        if not all(manifest.get("concept_info") or [None]):
            raise ValueError("the concept set has no calibration: use /readout raw [LAYER]")
        return ReadoutView(mode or "running")
    if mode != "raw" or (layer_arg and not layer_arg.isdigit()):
        raise ValueError(f"/readout takes nothing, 'running', 'token', 'raw [LAYER]' or 'off', not {arg!r}")
    layers = manifest["layers"]
    layer = int(layer_arg) if layer_arg else layers[-1]
    if layer not in layers:
        raise ValueError(f"layer {layer} is not read out; the concept set reads layers {layers}")
    return ReadoutView("raw", layer)


def readout_table(view: ReadoutView, manifest: dict, rows: Sequence[dict], texts: Sequence[str]) -> list[str]:
    """A header, then one line per row: its position, its token's text and each concept's value."""
    concepts = manifest["concepts"]
    columns = view.columns(manifest)
    widths = [max(10, len(c) + 2) for c in concepts]
    lines = [f"{'pos':>5}  {'token':<14}" + "".join(f"{c:>{w}}" for c, w in zip(concepts, widths, strict=True))]
    for payload, text in zip(rows, texts, strict=True):
        cells = "".join(f"{view.number(payload['readout'][c]):>{w}}" for c, w in zip(columns, widths, strict=True))
        lines.append(f"{payload['position']:>5}  {text!r:<14}" + cells)
    if view.probability and any(payload["position"] == 0 for payload in rows):
        lines.append(WHY_NOT_READ)
    return lines


def readout_summary(view: ReadoutView, manifest: dict, rows: Sequence[dict], texts: Sequence[str]) -> list[str]:
    """One line per concept over the rows (a chat reply's tokens), as a reader asks "was this reply
    French, and where?": in the running view its value at the reply's last token (the text so far,
    as read), otherwise the mean; then the largest and the token where it occurs (the first, on a tie)."""
    if not rows:
        return ["no reply tokens were read out"]
    what = f"{view.mode} probability" if view.probability else f"raw value at layer {view.layer}"
    first, last = rows[0]["position"], rows[-1]["position"]
    summary = "last" if view.mode == "running" else "mean"
    lines = [f"the reply's {len(rows)} tokens (positions {first}-{last}), each concept's {summary} and largest {what}:"]
    concepts = manifest["concepts"]
    width = max(map(len, concepts))
    for concept, column in zip(concepts, view.columns(manifest), strict=True):
        values = [payload["readout"][column] for payload in rows]
        top = max(range(len(values)), key=lambda i: -math.inf if math.isnan(values[i]) else values[i])
        read = [v for v in values if not math.isnan(v)]
        told = read[-1] if summary == "last" and read else sum(read) / len(read) if read else math.nan
        lines.append(
            f"  {concept:<{width}}  {summary} {view.number(told)}"
            f"  max {view.number(values[top])} at {texts[top]!r} (position {rows[top]['position']})"
        )
    return lines


def concept_facts(info: dict) -> str:
    """A calibrated concept in one line: how it was fitted, and its held-out figures at the recommended
    layer with their intervals, then the builder's warning if it has one."""
    best = next(fit for fit in info["layers"] if fit["layer"] == info["recommended_layer"])
    facts = f"{info['method']}, layer {info['recommended_layer']}, held-out AUROC {best['auroc']:.3f}"
    if best.get("auroc_interval"):
        low, high = best["auroc_interval"]
        facts += f" ({low:.3f}-{high:.3f})"
    if best.get("background_fpr") is not None:
        low, high = best["background_fpr_interval"]
        facts += f", background false positives {best['background_fpr']:.0%} ({low:.0%}-{high:.0%})"
    if "n_positive" in info:
        facts += f", {info['n_positive']}+{info['n_negative']} examples"
    if info.get("warning"):
        facts += f"; warning: {info['warning']}"
    return facts
