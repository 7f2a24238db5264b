"""Model folders Salience writes must load with transformers 4.x and 5.x.

LMQL 0.7.3 tokenizes client-side with transformers < 5. A tokenizer folder
saved by 5.x names the class `TokenizersBackend`, which 4.x does not know
(`PreTrainedTokenizerFast` loads the same tokenizer.json in both), and may list
`extra_special_tokens`, which 4.x reads only as a dict; both versions read the
list under its 4.x name, `additional_special_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["make_tokenizer_portable"]

_PORTABLE_CLASS = "PreTrainedTokenizerFast"


def make_tokenizer_portable(folder: Path) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    portable = dict(config, tokenizer_class=_PORTABLE_CLASS)
    if isinstance(portable.get("extra_special_tokens"), list):
        portable["additional_special_tokens"] = portable.pop("extra_special_tokens")
    if portable != config:
        path.write_text(json.dumps(portable, indent=2, ensure_ascii=False) + "\n")
