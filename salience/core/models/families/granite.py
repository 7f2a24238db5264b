"""Granite: Llama-like weights, but each layer returns the whole stream (its residual multiplier
applied inside), and the embedding and logits are scaled by config multipliers."""

from salience.core.models.families.family import Family, points_of

# Attention and the MLP add their outputs times residual_multiplier, which no module returns: the
# points between the adds only.
UNSCALED = ("attn_out", "mlp_out")

FAMILY = Family(
    name="Granite",
    architectures=("GraniteForCausalLM",),
    vllm_points=points_of(pair=False, layer_arg=1, without=UNSCALED),
    hf_points=points_of(pair=False, without=UNSCALED),
)
