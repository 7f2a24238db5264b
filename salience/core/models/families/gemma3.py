"""Gemma 3 (Gemma Scope 2), text-only from 270M to 1B; from 4B the language model of
Gemma3ForConditionalGeneration, whose sizes sit under text_config. Laid out as Gemma 2 is."""

import dataclasses

from salience.core.models.families import gemma2

FAMILY = dataclasses.replace(gemma2.FAMILY, name="Gemma 3", architectures=("Gemma3ForCausalLM",))
