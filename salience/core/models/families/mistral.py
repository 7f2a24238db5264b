"""Mistral: Llama's layout (vLLM's MistralModel subclasses LlamaModel)."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Mistral", architectures=("MistralForCausalLM",))
