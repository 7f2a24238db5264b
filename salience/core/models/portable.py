"""Model folders Salience writes must load with transformers 4.x and 5.x as the same model.

LMQL 0.7.3 tokenizes client-side with transformers < 5, and an LMQL user may load the
folder's model there too. Two things 5.x writes differently:

- Tokenizer. A tokenizer folder saved by 5.x names the class `TokenizersBackend`, which
  4.x does not know (`PreTrainedTokenizerFast` loads the same tokenizer.json in both),
  and may list `extra_special_tokens`, which 4.x reads only as a dict; both versions
  read the list under its 4.x name, `additional_special_tokens`.
- Config. 5.x keeps RoPE settings only in `rope_parameters`; 4.x reads `rope_theta`
  (and `partial_rotary_factor`) at the top level and the scaling type and its factors
  in `rope_scaling`, and silently uses its defaults when they are missing: a Llama
  then runs RoPE base 10000 whatever the folder says. We write the 4.x keys next to
  `rope_parameters`, in every (sub-)config. 5.x reads them back to the same
  parameters: it takes `rope_scaling` as `rope_parameters` and fills `rope_theta`
  from the top level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["make_portable", "portable_config"]

_PORTABLE_CLASS = "PreTrainedTokenizerFast"
# Moved into rope_parameters by 5.x; 4.x reads them at the config's top level.
_TOP_LEVEL_KEYS = ("rope_theta", "partial_rotary_factor")


def make_portable(folder: Path) -> None:
    """Rewrite the folder's config.json and tokenizer_config.json (those present) for 4.x and 5.x."""
    _rewrite(folder / "config.json", portable_config)
    _rewrite(folder / "tokenizer_config.json", _portable_tokenizer_config)


def portable_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config with 4.x's spelling of the RoPE settings added, in it and every sub-config."""
    portable = {k: portable_config(v) if isinstance(v, dict) else v for k, v in config.items()}
    rope = portable.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return portable  # absent, or nested per layer type: no single 4.x spelling
    for key in _TOP_LEVEL_KEYS:
        if key in rope and portable.get(key) is None:
            portable[key] = rope[key]
    scaling = {k: v for k, v in rope.items() if k not in _TOP_LEVEL_KEYS}
    if scaling != {"rope_type": "default"} and portable.get("rope_scaling") is None:  # default: 4.x's None
        portable["rope_scaling"] = scaling
    return portable


def _portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    portable = dict(config, tokenizer_class=_PORTABLE_CLASS)
    if isinstance(portable.get("extra_special_tokens"), list):
        portable["additional_special_tokens"] = portable.pop("extra_special_tokens")
    return portable


def _rewrite(path: Path, change) -> None:
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    portable = change(config)
    if portable != config:
        path.write_text(json.dumps(portable, indent=2, ensure_ascii=False) + "\n")
