"""Gemma: the embedding scaled by sqrt(hidden) (inside the model, so resid_pre of layer 0 is the
scaled one) and RMS norms that multiply by 1 + weight."""

from salience.core.models.families.family import Family

FAMILY = Family(name="Gemma", architectures=("GemmaForCausalLM",), norm="rms_plus_one")
