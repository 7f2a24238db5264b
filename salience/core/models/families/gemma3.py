"""Gemma 3 (Gemma Scope 2), text-only from 270M to 1B; from 4B the language model of
Gemma3ForConditionalGeneration, whose sizes sit under text_config."""

from salience.core.models.families.family import Family
from salience.core.models.families.gemma2 import HF_POINTS, VLLM_POINTS

FAMILY = Family(
    name="Gemma 3",
    architectures=("Gemma3ForCausalLM",),
    norm="rms_plus_one",
    vllm_points=VLLM_POINTS,
    hf_points=HF_POINTS,
)
