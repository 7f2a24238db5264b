"""The model's configuration as transformers reads it, its defaults filled in. One reading serves
two decisions: the shapes the SAEs are checked against (settings_checks.py) and the longest
prompt vLLM must take whole (vllm_args.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from salience.core.engine.settings import EngineSettings

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["text_config"]


def text_config(settings: EngineSettings) -> PretrainedConfig:
    """The model's text configuration (a vision-language model's language model's)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(settings.model)
    return getattr(config, "text_config", None) or config
