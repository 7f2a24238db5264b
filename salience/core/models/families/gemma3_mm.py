"""Gemma 3's multimodal checkpoints (4B and up): the Gemma 3 language model under a vision tower."""

from salience.core.models.families.family import Family
from salience.core.models.families.gemma2 import HF_POINTS, VLLM_POINTS

FAMILY = Family(
    name="Gemma 3 (multimodal)",
    architectures=("Gemma3ForConditionalGeneration",),
    vllm_stack="language_model.model",
    hf_stack="model.language_model",
    norm="rms_plus_one",
    compiled=False,
    vllm_points=VLLM_POINTS,
    hf_points=HF_POINTS,
)
