"""`salience serve` as a user runs it: a real process, real ports, what it refuses to start with.
(A whole start, ready to stopped by SIGTERM, is test_drain.py's first test.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import free_port

SALIENCE = str(Path(sys.executable).with_name("salience"))


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: (d / "file").write_text("x") and d / "file", "is not a folder"),
        (lambda d: (d / "empty").mkdir() or d / "empty", "has no config.json"),
        (lambda d: _folder(d, "{not json"), "cannot read"),
        (lambda d: _folder(d, json.dumps({"architectures": ["NoSuchForCausalLM"]})), "NoSuchForCausalLM is not"),
        (lambda d: _folder(d, json.dumps({"model_type": "llama"})), "names no architectures"),
    ],
)
def test_bad_model_folder_ends_with_one_line_and_exit_code_2(tmp_path: Path, setup, message: str) -> None:
    model = setup(tmp_path)
    result = subprocess.run(
        [SALIENCE, "serve", "--model", str(model), "--lmtp-port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("salience: error: ") and message in lines[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_unreadable_model_folder(tmp_path: Path) -> None:
    model = _folder(tmp_path, "{}")
    (model / "config.json").chmod(0)
    result = subprocess.run([SALIENCE, "serve", "--model", str(model)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "permission denied" in result.stderr


def _folder(root: Path, config: str) -> Path:
    folder = root / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    return folder


def test_a_message_limit_above_the_frame_ceiling_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    command = [SALIENCE, "serve", "--model", str(tmp_path / "missing"), "--lmtp-max-frame-bytes", "1000"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--lmtp-max-message-bytes (16777216) must be positive and at most --lmtp-max-frame-bytes (1000)" in (
        result.stderr
    )


def test_a_token_with_the_tcp_transport_is_refused(tiny_model: Path) -> None:
    command = [SALIENCE, "serve", "--model", str(tiny_model), "--auth-token", "t", "--lmtp-tcp-port", str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--lmtp-tcp-port cannot carry a token" in result.stderr


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "has no cfg.json"),
        ({"cfg.json": "{}"}, "has no sae_weights.safetensors"),
        ({"cfg.json": '{"architecture": "gated"}', "sae_weights.safetensors": ""}, "has no 'd_in'"),
    ],
)
def test_a_malformed_sae_folder_is_refused_before_the_model_loads(tmp_path: Path, files: dict, message: str) -> None:
    sae = tmp_path / "sae"
    sae.mkdir()
    for name, text in files.items():
        (sae / name).write_text(text)
    command = [SALIENCE, "serve", "--model", str(tmp_path / "missing"), "--sae", f"mine={sae}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--residual-memory", "0", "--residual-memory must be 1 or more, got 0"),
        ("--max-residual-rows", "-5", "--max-residual-rows must be 1 or more, got -5"),
        ("--spare-concepts", "-1", "--spare-concepts must be 0 or more, got -1"),
    ],
)
def test_a_bad_limit_is_refused_before_the_model_loads(tmp_path: Path, flag: str, value: str, message: str) -> None:
    command = [SALIENCE, "serve", "--model", str(tmp_path / "missing"), flag, value]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
