"""What Salience needs to know about one model family, in one value.

vLLM and transformers lay each family out their own way: where the decoder stack is, what a layer
returns, what the config calls its sizes, how the embedding is named, and how the final norm and
unembedding turn a residual vector into logits. Everything that reads or writes the residual
(taps, the fingerprint, the logit lens, the concept builder) asks the family instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

__all__ = ["Family", "Norm", "Stream"]

# How the final norm scales a vector: RMS with weight w (x * w), Gemma's RMS (x * (1 + w)), or a
# LayerNorm (x centred, times w, plus a bias that adds the same to every vector).
Norm = Literal["rms", "rms_plus_one", "layer"]
# How vLLM's decoder layer hands on the residual stream: a pair (hidden, residual) whose sum it
# is (the fused add-norm layers), or the stream itself (possibly [1, tokens, hidden] where vLLM
# runs transformers' own layers).
Stream = Literal["pair", "whole"]


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
    stream: Stream = "pair"
    hidden_key: str = "hidden_size"
    layers_key: str = "num_hidden_layers"
    embedding: str = "embed_tokens.weight"  # the input embedding's tensor name ends so
    final_norm: str = "norm"  # the final norm's tensor name ends with `final_norm`.weight
    norm: Norm = "rms"
    unembedding: tuple[str, ...] = ("lm_head.weight",)  # else the input embedding (tied)
    # Proven exact in vLLM's compiled graph (tests/test_families.py); else the taps run eagerly.
    compiled: bool = True

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
