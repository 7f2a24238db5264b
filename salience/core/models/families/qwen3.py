"""Qwen3: Qwen2's layout with per-head q and k norms (the Qwen3 transcoders' models)."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Qwen3", architectures=("Qwen3ForCausalLM",))
