"""Phi-3: Llama's code in vLLM (Phi3ForCausalLM subclasses LlamaForCausalLM), fused qkv and gate-up
projections in its checkpoint."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Phi-3", architectures=("Phi3ForCausalLM",))
