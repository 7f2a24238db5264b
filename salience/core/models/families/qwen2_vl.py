"""Qwen2-VL: a Qwen2 language model under a vision tower; images go in as embeddings."""

from salience.core.models.families.family import Family

FAMILY = Family(
    name="Qwen2-VL",
    architectures=("Qwen2VLForConditionalGeneration",),
    vllm_stack="language_model.model",
    hf_stack="model.language_model",
)
