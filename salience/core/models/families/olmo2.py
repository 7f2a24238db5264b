"""OLMo 2: post-norm layers (no input norm); vLLM runs transformers' own layers, which see
[1, tokens, hidden]."""

from salience.core.models.families.family import Family, points_of

# Post-norms as Gemma 2's, and no norm before the MLP: its input is the residual after attention.
# vLLM runs transformers' own layers.
POINTS = points_of(attn_out="post_attention_layernorm", mid="mlp", mlp_out="post_feedforward_layernorm", pair=False)

FAMILY = Family(name="OLMo 2", architectures=("Olmo2ForCausalLM",), vllm_points=POINTS, hf_points=POINTS)
