"""Gemma 3's multimodal checkpoints (4B and up): the Gemma 3 language model under a vision tower."""

from salience.core.models.families.family import Family

FAMILY = Family(
    name="Gemma 3 (multimodal)",
    architectures=("Gemma3ForConditionalGeneration",),
    vllm_stack="language_model.model",
    hf_stack="model.language_model",
    norm="rms_plus_one",
    compiled=False,
)
