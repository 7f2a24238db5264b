"""Folders Salience writes load with transformers 4.x (LMQL's client) and 5.x alike: same tokens, same logits."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from salience.core.models.portable import portable_config
from tests.folder_logits import folder_logits
from tools.lmql_env import client_python

FOLDER_LOGITS = Path(__file__).with_name("folder_logits.py")

TEXT = "Hello, wörld! def f(x):\n    return x ** 2  # 日本 🎉"


MODELS = ["default_model", "tiny_model", "tiny_vl_model"]


@pytest.fixture(scope="module")
def tokenized_under_transformers_4(request: pytest.FixtureRequest) -> tuple[str, dict[str, tuple[list[int], int]]]:
    """transformers 4.x's version, and its ids of TEXT and EOS id for every model folder, from one
    subprocess (each costs seconds of imports)."""
    folders = [str(request.getfixturevalue(name)) for name in MODELS]
    script = (
        "import json, sys, transformers\n"
        "from transformers import AutoTokenizer\n"
        "out = {}\n"
        "for folder in sys.argv[2:]:\n"
        "    t = AutoTokenizer.from_pretrained(folder)\n"
        "    out[folder] = [t(sys.argv[1])['input_ids'], t.eos_token_id]\n"
        "print(json.dumps([transformers.__version__, out]))\n"
    )
    result = subprocess.run(
        [client_python(), "-c", script, TEXT, *folders], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    version, out = json.loads(result.stdout.strip().splitlines()[-1])
    return version, {name: tuple(out[folder]) for name, folder in zip(MODELS, folders, strict=True)}


@pytest.mark.parametrize("model", MODELS)
def test_tokenizer_loads_and_agrees_under_transformers_4(
    model: str, request: pytest.FixtureRequest, tokenized_under_transformers_4
) -> None:
    version, tokenized = tokenized_under_transformers_4
    ids, eos = tokenized[model]
    assert version.startswith("4.")
    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(model))
    assert ids == tokenizer(TEXT)["input_ids"]
    assert eos == tokenizer.eos_token_id


# A 5.x config.json keeps RoPE settings only here; 4.x reads them at the top level.
LLAMA_5X = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


def test_portable_config_adds_the_4x_rope_keys() -> None:
    assert portable_config(LLAMA_5X) == {**LLAMA_5X, "rope_theta": 100000.0}
    yarn = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}}
    assert portable_config(yarn) == {
        **yarn,
        "rope_theta": 5e5,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    vl = {"text_config": {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "mrope_section": [4, 6, 6]}}}
    assert portable_config(vl)["text_config"] == {
        **vl["text_config"],
        "rope_theta": 1e4,
        "rope_scaling": {"rope_type": "default", "mrope_section": [4, 6, 6]},
    }
    per_layer_type = {
        "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}
    }
    assert portable_config(per_layer_type) == per_layer_type  # no single 4.x spelling
    assert portable_config(portable_config(yarn)) == portable_config(yarn)


def test_transformers_4_reads_rope_theta_only_from_the_portable_config(tmp_path: Path) -> None:
    """The bug this guards: 4.x silently runs RoPE base 10000 on a 5.x-only config."""
    for name, config in [("5x", LLAMA_5X), ("portable", portable_config(LLAMA_5X))]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    script = (
        "import json, sys\n"
        "from transformers import AutoConfig\n"
        "print(json.dumps([AutoConfig.from_pretrained(f).rope_theta for f in sys.argv[1:]]))\n"
    )
    result = subprocess.run(
        [client_python(), "-c", script, tmp_path / "5x", tmp_path / "portable"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [10000.0, 100000.0]


# Every id is in the tiny models' 2048-token vocabulary; 32 positions, so RoPE's base shows.
IDS = [1, 504, 1365, 654, 1638, 270, 690, 260, 1790, 1767, 30, 378, 1000, 200, 300, 400]
IDS += [500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500, 1600, 1700, 1800, 1900, 2000]


def _five_only(folder: Path, out: Path) -> Path:
    """The folder as Salience wrote it before portable configs: 4.x's RoPE keys removed."""
    out.mkdir()
    for path in folder.iterdir():
        (out / path.name).symlink_to(path)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_theta", "partial_rotary_factor", "rope_scaling"):
        config.pop(key, None)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def logits_under_transformers_4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The 4.x logits of every model folder, and of the default model's old layout, from one subprocess."""
    folders = {name: request.getfixturevalue(name) for name in MODELS}
    out = tmp_path_factory.mktemp("logits4")
    folders["old default_model"] = _five_only(folders["default_model"], out / "old-default")
    result = subprocess.run(
        [client_python(), FOLDER_LOGITS, out, json.dumps(IDS), *folders.values()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("4.")
    return {name: np.load(out / f"{i}.npy") for i, name in enumerate(folders)}, folders


def _relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("model", MODELS)
def test_logits_agree_under_transformers_4_and_5(model: str, logits_under_transformers_4) -> None:
    logits4, folders = logits_under_transformers_4
    logits5 = folder_logits(folders[model], IDS)
    assert logits5.shape == logits4[model].shape == (len(IDS), logits5.shape[1])
    assert _relative_difference(logits4[model], logits5) < 1e-4  # measured: 0.0


def test_without_the_4x_keys_transformers_4_runs_another_model(logits_under_transformers_4) -> None:
    logits4, folders = logits_under_transformers_4
    logits5 = folder_logits(folders["default_model"], IDS)
    assert _relative_difference(logits4["old default_model"], logits5) > 0.01  # measured: 0.115
