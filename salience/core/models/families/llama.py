"""Llama (Llama 2 and 3, Llama Scope's and Goodfire's models): the layout most families copy."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Llama", architectures=("LlamaForCausalLM",))
