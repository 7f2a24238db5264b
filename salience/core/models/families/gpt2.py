"""GPT-2 (gpt2-small's SAE releases): `transformer.h`, n_embd and n_layer, learned position
embeddings added before layer 0, a LayerNorm with a bias, and the unembedding tied to wte."""

from salience.core.models.families.family import Family, points_of

POINTS = points_of(attn_out="attn", mid="ln_2", pair=False)  # vLLM's block is transformers' layout

FAMILY = Family(
    name="GPT-2",
    architectures=("GPT2LMHeadModel",),
    vllm_stack="transformer",
    hf_stack="transformer",
    layers="h",
    hidden_key="n_embd",
    layers_key="n_layer",
    embedding="wte.weight",
    final_norm="ln_f",
    norm="layer",
    vllm_points=POINTS,
    hf_points=POINTS,
)
