"""Gemma 3's multimodal checkpoints (4B and up): the Gemma 3 language model under a vision tower."""

import dataclasses

from salience.core.models.families import gemma3

FAMILY = dataclasses.replace(
    gemma3.FAMILY,
    name="Gemma 3 (multimodal)",
    architectures=("Gemma3ForConditionalGeneration",),
    vllm_stack="language_model.model",
    hf_stack="model.language_model",
    compiled=False,
)
