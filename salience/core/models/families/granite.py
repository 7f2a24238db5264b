"""Granite: Llama-like weights, but each layer returns the whole stream (its residual multiplier
applied inside), and the embedding and logits are scaled by config multipliers."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Granite", architectures=("GraniteForCausalLM",), stream="whole")
