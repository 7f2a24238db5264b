"""Hook points: the places in a decoder layer where Salience reads or writes the residual stream,
named as TransformerLens names them.

Per layer L (TransformerLens's semantics, float32):

    resid_pre   the residual entering layer L (layer 0: the embeddings as the model scales them)
    resid_mid   after attention, before the MLP (a parallel-residual family has none)
    attn_out    what attention adds to the residual (after a post-norm, as Gemma 2's)
    mlp_in      the MLP's normalized input, which a transcoder reads
    mlp_out     what the MLP adds to the residual (after a post-norm)
    resid_post  the residual leaving layer L: Salience's point before there were others

Where each point is in vLLM's and in transformers' module tree is the family's to say
(`Location`, in each family's module); this module only knows the names. A hook name is read as
TransformerLens 3 spells it (`blocks.L.hook_resid_pre`), as TransformerLens 4's bridge does
(`blocks.L.hook_in`), or as a transformers module path (`model.layers.L`: the layer's output).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["POINTS", "STREAM", "Location", "Point", "Site", "parse_hook"]

Point = Literal["resid_pre", "resid_mid", "attn_out", "mlp_in", "mlp_out", "resid_post"]
POINTS: tuple[Point, ...] = get_args(Point)
# The residual stream itself, as against a branch off it: where the layer's code holds the stream
# in one tensor that the residual and a branch both read (transformers' `residual = hidden_states`
# before a norm), a write at a stream point reaches both, and a write at a branch point (an MLP
# input that is that same tensor, as OLMo 2's is) must reach the branch alone.
STREAM: frozenset[Point] = frozenset({"resid_pre", "resid_mid", "resid_post"})


@dataclass(frozen=True, order=True)
class Site:
    """One point of one layer."""

    layer: int
    point: Point = "resid_post"

    def __str__(self) -> str:
        return f"blocks.{self.layer}.hook_{self.point}"


@dataclass(frozen=True)
class Location:
    """Where a point is in one decoder layer: the input or the output of the module at attribute
    path `module` inside the layer ("" is the layer itself). With `pair`, the stream there is the
    sum of two tensors, hidden then residual (vLLM's fused add-norm layers and their norms);
    otherwise the one tensor (the first of a tuple output). An input is argument `arg`, or the
    keyword `hidden_states`."""

    module: str
    side: Literal["input", "output"]
    pair: bool = False
    arg: int = 0


# TransformerLens 3's names, then TransformerLens 4's bridge names for the same points.
_LEGACY = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "hook_resid_post": "resid_post",
    "ln2.hook_normalized": "mlp_in",
    "hook_mlp_in": "mlp_in",
}
_BRIDGE = {
    "hook_in": "resid_pre",
    "ln2.hook_in": "resid_mid",
    "attn.hook_out": "attn_out",
    "mlp.hook_in": "mlp_in",
    "mlp.hook_out": "mlp_out",
    "hook_out": "resid_post",
}
_NAMES = {**_LEGACY, **_BRIDGE}
_TL = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"(?:\w+\.)*(?:layers|h)\.(\d+)")


def parse_hook(name: str) -> Site:
    """The site a hook name reads; ValueError naming the supported spellings if it is none."""
    if (m := _TL.fullmatch(name)) and m.group(2) in _NAMES:
        return Site(int(m.group(1)), _NAMES[m.group(2)])
    if m := _HF_LAYER.fullmatch(name):
        return Site(int(m.group(1)))
    raise ValueError(
        f"hook {name!r} is not a point Salience reads; it reads blocks.L.hook_<point> for point in "
        f"{', '.join(POINTS)} (TransformerLens 4: blocks.L.{', blocks.L.'.join(_BRIDGE)}; "
        "blocks.L.ln2.hook_normalized is mlp_in), and module paths like model.layers.L (resid_post)"
    )
