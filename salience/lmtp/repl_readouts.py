"""The REPL's `/readout` view: which value of a readout row each concept shows, and how rows print.

Kept out of repl.py so the connection loop stays short; nothing here talks to the server, so the
table and chat mode's per-concept summary are tested without one. A readout row is flat and
layer-major (`len(layers) * len(concepts)` values, docs/lmtp.md), so a concept's value at a layer
is one column of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReadoutView", "choose_readout", "readout_summary", "readout_table"]


@dataclass(frozen=True)
class ReadoutView:
    """What `/readout` shows: "probability" (each concept at its recommended layer, 0.00-1.00) or
    "raw" (every concept's projection at `layer`)."""

    mode: str
    layer: int | None = None

    @property
    def probability(self) -> bool:
        return self.mode == "probability"

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
        return f"{value:.2f}" if self.probability else f"{value:.4g}"

    def header(self, manifest: dict) -> str:
        """What `/readout` answers: the concepts and where each is read."""
        if self.probability:
            layers = ", ".join(f"{i['name']}@{i['recommended_layer']}" for i in manifest["concept_info"])
            return f"concept probabilities, each at its recommended layer: {layers}"
        return f"raw readouts at layer {self.layer} of {', '.join(manifest['concepts'])}"


def choose_readout(arg: str, manifest: dict | None) -> ReadoutView:
    """`/readout [raw [LAYER]]` against MODEL_INFO's readout manifest; ValueError says what is wrong.
    Probabilities need a calibrated set; raw readouts default to the deepest layer read."""
    if not manifest:
        raise ValueError("the server has no concept set: it reads nothing out")
    mode, _, layer_arg = arg.partition(" ")
    layer_arg = layer_arg.strip()
    if mode == "":
        if not all(manifest.get("concept_info") or [None]):
            raise ValueError("the concept set has no calibration: use /readout raw [LAYER]")
        return ReadoutView("probability")
    if mode != "raw" or (layer_arg and not layer_arg.isdigit()):
        raise ValueError(f"/readout takes nothing, 'raw [LAYER]' or 'off', not {arg!r}")
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
    return lines


def readout_summary(view: ReadoutView, manifest: dict, rows: Sequence[dict], texts: Sequence[str]) -> list[str]:
    """One line per concept over the rows (a chat reply's tokens): the mean value, the largest and the
    token where it occurs (the first, on a tie), as a reader asks "was this reply French, and where?"."""
    if not rows:
        return ["no reply tokens were read out"]
    what = "probability" if view.probability else f"raw value at layer {view.layer}"
    first, last = rows[0]["position"], rows[-1]["position"]
    lines = [f"the reply's {len(rows)} tokens (positions {first}-{last}), each concept's mean and largest {what}:"]
    concepts = manifest["concepts"]
    width = max(map(len, concepts))
    for concept, column in zip(concepts, view.columns(manifest), strict=True):
        values = [payload["readout"][column] for payload in rows]
        top = max(range(len(values)), key=values.__getitem__)
        lines.append(
            f"  {concept:<{width}}  mean {view.number(sum(values) / len(values))}"
            f"  max {view.number(values[top])} at {texts[top]!r} (position {rows[top]['position']})"
        )
    return lines
