"""GPT-NeoX (Pythia): parallel residual by default (attention and MLP both read the layer's input),
a LayerNorm with a bias, and an untied `embed_out`. vLLM runs transformers' own layers, which see
[1, tokens, hidden], under `model` where transformers has `gpt_neox`."""

from salience.core.models.families.family import Family, points_of

# Parallel residual: both branches read the layer's input, so there is no residual between them.
POINTS = points_of(attn_out="attention", pair=False, without=("resid_mid",))

FAMILY = Family(
    name="GPT-NeoX",
    architectures=("GPTNeoXForCausalLM",),
    hf_stack="gpt_neox",
    embedding="embed_in.weight",
    final_norm="final_layer_norm",
    norm="layer",
    unembedding=("embed_out.weight", "lm_head.weight"),
    vllm_points=POINTS,
    hf_points=POINTS,
)
