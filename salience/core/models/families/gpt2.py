"""GPT-2 (gpt2-small's SAE releases): `transformer.h`, n_embd and n_layer, learned position
embeddings added before layer 0, a LayerNorm with a bias, and the unembedding tied to wte."""

from salience.core.models.families.family import Family

FAMILY = Family(
    name="GPT-2",
    architectures=("GPT2LMHeadModel",),
    vllm_stack="transformer",
    hf_stack="transformer",
    layers="h",
    stream="whole",
    hidden_key="n_embd",
    layers_key="n_layer",
    embedding="wte.weight",
    final_norm="ln_f",
    norm="layer",
)
