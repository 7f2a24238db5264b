"""OLMo 2: post-norm layers (no input norm); vLLM runs transformers' own layers, which see
[1, tokens, hidden]."""

from salience.core.models.families.family import Family

FAMILY = Family(name="OLMo 2", architectures=("Olmo2ForCausalLM",), stream="whole")
