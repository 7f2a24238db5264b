"""`salience convert`: what the GGUF loader leaves out is put back, and bad arguments stop it in
one line. The whole conversion runs on every fresh machine, for the default model (conftest)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from transformers import AutoTokenizer

from salience.core.models.gguf_folder import put_bos_first
from salience.core.models.reading import text_ids
from tests.test_serve import SALIENCE


def test_a_tokenizer_that_drops_the_gguf_bos_puts_it_first_once(tiny_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, folder / name)
    before = AutoTokenizer.from_pretrained(folder)
    plain = before("The cat sat.").input_ids
    assert plain[0] != before.bos_token_id
    put_bos_first(folder)
    put_bos_first(folder)  # a second pass must not add a second BOS
    after = AutoTokenizer.from_pretrained(folder)
    assert after("The cat sat.").input_ids == [after.bos_token_id, *plain]
    # Concepts are fitted on what the model reads: BOS first where the tokenizer puts it.
    assert text_ids(before, "The cat sat.") == plain
    assert text_ids(after, "The cat sat.") == [after.bos_token_id, *plain]
    assert after("a", "b").input_ids == [
        after.bos_token_id,
        *before("a").input_ids,
        after.bos_token_id,
        *before("b").input_ids,
    ]


def test_bad_arguments_stop_the_conversion_in_one_line(tiny_model: Path, tmp_path: Path) -> None:
    missing = tmp_path / "none.gguf"
    for args, message in (
        ([missing, tmp_path / "out"], f"{missing}: no such GGUF file"),
        ([tiny_model / "config.json", tiny_model], f"{tiny_model} exists: name a new folder"),
    ):
        result = subprocess.run([SALIENCE, "convert", *map(str, args)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [f"salience: error: {message}"]
    assert not (tmp_path / "out").exists()
