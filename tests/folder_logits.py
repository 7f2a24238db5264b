"""A model folder's float32 logits under whichever transformers runs this file.

Imported by the tests (transformers 5.x) and run as a script by the client
environment's Python (transformers 4.x, tools/lmql_env.py), which has no Salience:

    python tests/folder_logits.py OUT_DIR '[ids]' FOLDER...

writes OUT_DIR/<i>.npy, [positions, vocab] float64, for the i-th folder, and prints
the transformers version.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import transformers


def folder_logits(folder: Path, ids: Sequence[int]) -> np.ndarray:
    """Logits after each prefix of ids; a vision-language folder runs text-only."""
    config = transformers.AutoConfig.from_pretrained(folder)
    auto = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") else None
    model = (auto or transformers.AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([list(ids)])).logits[0].double().numpy()


if __name__ == "__main__":
    out, ids, folders = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:]
    for i, folder in enumerate(folders):
        np.save(out / f"{i}.npy", folder_logits(Path(folder), ids))
    print(transformers.__version__)
