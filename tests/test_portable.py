"""Folders Salience writes load with transformers 4.x (LMQL's client) and 5.x alike."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.client_env import client_python

TEXT = "Hello, wörld! def f(x):\n    return x ** 2  # 日本 🎉"


@pytest.mark.parametrize("model", ["default_model", "tiny_model", "tiny_vl_model"])
def test_tokenizer_loads_and_agrees_under_transformers_4(model: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(model)
    script = (
        "import json, sys, transformers\n"
        "from transformers import AutoTokenizer\n"
        "t = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "print(json.dumps([transformers.__version__, t(sys.argv[2])['input_ids'], t.eos_token_id]))\n"
    )
    result = subprocess.run(
        [client_python(), "-c", script, str(folder), TEXT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    version, ids, eos = json.loads(result.stdout.strip().splitlines()[-1])
    assert version.startswith("4.")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert ids == tokenizer(TEXT)["input_ids"]
    assert eos == tokenizer.eos_token_id
