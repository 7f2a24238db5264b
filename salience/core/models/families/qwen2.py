"""Qwen2 and Qwen2.5 (the embedded SmolLM2 is Llama; the tiny test model is Qwen2)."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Qwen2", architectures=("Qwen2ForCausalLM",))
