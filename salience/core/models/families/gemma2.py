"""Gemma 2 (Gemma Scope): Gemma's norms, post-norms on attention and MLP outputs, and soft-capped
logits (tanh, monotonic: a logit lens's ranking is the uncapped one)."""

from salience.core.models.families.family import Family, points_of

# Attention's and the MLP's outputs are the post-norms' (what the residual gets), and the residual
# between them enters the pre-feedforward norm; Gemma 3 is laid out the same.
POST_NORMED = dict(
    attn_out="post_attention_layernorm", mid="pre_feedforward_layernorm", mlp_out="post_feedforward_layernorm"
)

FAMILY = Family(
    name="Gemma 2",
    architectures=("Gemma2ForCausalLM",),
    norm="rms_plus_one",
    vllm_points=points_of(**POST_NORMED, pair=True, layer_arg=1),
    hf_points=points_of(**POST_NORMED, pair=False),
)
