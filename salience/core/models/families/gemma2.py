"""Gemma 2 (Gemma Scope): Gemma's norms, post-norms on attention and MLP outputs, and soft-capped
logits (tanh, monotonic: a logit lens's ranking is the uncapped one)."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Gemma 2", architectures=("Gemma2ForCausalLM",), norm="rms_plus_one")
