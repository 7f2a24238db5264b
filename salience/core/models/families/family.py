"""What Salience needs to know about one model family, in one value.

vLLM and transformers lay each family out their own way: where the decoder stack is, what a layer
returns, what the config calls its sizes, how the embedding is named, and how the final norm and
unembedding turn a residual vector into logits. Everything that reads or writes the residual
(taps, the fingerprint, the logit lens, the concept builder) asks the family instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from salience.core.models.points import Location, Point
from salience.errors import ModelError

if TYPE_CHECKING:
    import torch

__all__ = ["HF_POINTS", "VLLM_POINTS", "Family", "Norm", "points_of"]

# How the final norm scales a vector: RMS with weight w (x * w), Gemma's RMS (x * (1 + w)), or a
# LayerNorm (x centred, times w, plus a bias that adds the same to every vector).
Norm = Literal["rms", "rms_plus_one", "layer"]
Points = Mapping[Point, Location]


def points_of(
    *,
    attn_out: str = "self_attn",
    mid: str = "post_attention_layernorm",
    mlp: str = "mlp",
    mlp_out: str | None = None,
    pair: bool,
    layer_arg: int = 0,
    without: tuple[Point, ...] = (),
) -> Points:
    """A layer laid out as most are: attention's output is `attn_out`'s, the MLP's input and
    output are `mlp`'s (or `mlp_out`'s output, a post-norm), and the residual between them is the
    input of `mid` (the norm before the MLP). With `pair`, the stream is vLLM's (hidden,
    residual) pair at the layer's input and output and at `mid`'s input; the layer takes its
    hidden states as argument `layer_arg`. Points in `without` are ones the family lacks."""
    points: dict[Point, Location] = {
        "resid_pre": Location("", "input", pair=pair, arg=layer_arg),
        "resid_mid": Location(mid, "input", pair=pair),
        "attn_out": Location(attn_out, "output"),
        "mlp_in": Location(mlp, "input"),
        "mlp_out": Location(mlp_out or mlp, "output"),
        "resid_post": Location("", "output", pair=pair),
    }
    return {point: where for point, where in points.items() if point not in without}


# Llama's layout, which most families copy: vLLM's layer is called (positions, hidden, residual).
VLLM_POINTS = points_of(pair=True, layer_arg=1)
HF_POINTS = points_of(pair=False)


@dataclass(frozen=True, kw_only=True)
class Family:
    """One family's layout. `architectures` are the names config.json gives; the paths are
    attribute paths from the model object to the owner of the decoder layers (which also holds
    a pipeline stage's `start_layer` and `end_layer`, where vLLM sets them)."""

    name: str
    architectures: tuple[str, ...]
    vllm_stack: str = "model"  # the owner of the layer list in vLLM's model
    hf_stack: str = "model"  # the same in transformers' *ForCausalLM
    layers: str = "layers"  # the layer list's attribute on both owners
    hidden_key: str = "hidden_size"
    layers_key: str = "num_hidden_layers"
    embedding: str = "embed_tokens.weight"  # the input embedding's tensor name ends so
    final_norm: str = "norm"  # the final norm's tensor name ends with `final_norm`.weight
    norm: Norm = "rms"
    unembedding: tuple[str, ...] = ("lm_head.weight",)  # else the input embedding (tied)
    # Proven exact in vLLM's compiled graph (tests/test_families.py); else the taps run eagerly.
    compiled: bool = True
    # Where each hook point is in a vLLM and in a transformers decoder layer; a point a family
    # lacks is absent (a parallel residual has no resid_mid).
    vllm_points: Points = field(default_factory=lambda: VLLM_POINTS)
    hf_points: Points = field(default_factory=lambda: HF_POINTS)

    def locate(self, point: Point, *, hf: bool = False, reader: str = "") -> Location:
        """Where `point` is in vLLM's layer (`hf`: transformers'); ModelError if the family has none,
        led by `reader` (what asked for the point) when given."""
        where = (self.hf_points if hf else self.vllm_points).get(point)
        if where is None:
            have = ", ".join(self.vllm_points)
            lead = f"{reader}, but " if reader else ""
            raise ModelError(f"{lead}{self.name} models have no hook point {point} (they have {have})")
        return where

    def stack(self, model: Any, path: str) -> tuple[Any, Any]:
        """The owner of the decoder layers at attribute path `path` (vllm_stack or hf_stack) from
        `model`, and its layer list."""
        owner = model
        for part in path.split("."):
            owner = getattr(owner, part)
        return owner, getattr(owner, self.layers)

    def norm_scale(self, direction: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`direction` as the final norm passes it on to the unembedding, up to one positive factor
        (1 / rms or 1 / std, the same for the whole vector, which changes no ranking): the logit
        lens's input. A LayerNorm's bias adds the same logits to every vector and is left out."""
        if self.norm == "rms_plus_one":
            return (1.0 + weight) * direction
        if self.norm == "layer":
            return weight * (direction - direction.mean())
        return weight * direction
