"""Model folders Salience writes must load with transformers 4.x and 5.x.

LMQL 0.7.3 tokenizes client-side with transformers < 5; a tokenizer folder
saved by 5.x names the class `TokenizersBackend`, which 4.x does not know.
`PreTrainedTokenizerFast` loads the same tokenizer.json in both.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["make_tokenizer_portable"]

_PORTABLE_CLASS = "PreTrainedTokenizerFast"


def make_tokenizer_portable(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") != _PORTABLE_CLASS:
        config["tokenizer_class"] = _PORTABLE_CLASS
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
