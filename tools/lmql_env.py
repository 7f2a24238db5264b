"""A separate virtualenv with what LMQL users run: lmql 0.7.3 and transformers 4.x, with CPU torch.

LMQL's client tokenizes on its side with transformers < 5, which cannot share the
server's environment (vLLM needs 5.x). torch is there so the same environment can
also run a model folder under transformers 4.x (tests/test_portable.py); the CPU
build is installed first and pinned, so nothing swaps in a CUDA one. Built once per
cache, atomically. `server_python` is the same with accelerate, for `lmql serve-model` in
tools/bench_lmtp.py.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from functools import partial
from pathlib import Path

from salience.core.models.atomic import build_folder_once
from salience.core.models.home import salience_home

TORCH = "torch==2.13.0"
REQUIREMENTS = ["lmql==0.7.3", "transformers==4.57.6", TORCH]


def _build(folder: Path, requirements: list[str]) -> None:
    venv.EnvBuilder(with_pip=True).create(folder)
    python = folder / "bin" / "python"
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True, stdout=sys.stderr)
    # Pin the exact local build (e.g. 2.13.0+cpu) for the rest of the install.
    installed = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    constraints = folder / "constraints.txt"
    constraints.write_text(f"torch=={installed}\n")
    subprocess.run([*pip, "-c", constraints, *requirements], check=True, stdout=sys.stderr)


def _python(key: str, requirements: list[str]) -> Path:
    """The Python of an environment (a moved venv still runs by its interpreter)."""
    folder = build_folder_once(salience_home() / "venvs" / key, partial(_build, requirements=requirements))
    return folder / "bin" / "python"


def client_python() -> Path:
    """The LMQL client environment's Python."""
    return _python("-".join(r.replace("==", "") for r in REQUIREMENTS), REQUIREMENTS)


def server_python() -> Path:
    """LMQL's own server with its transformers backend (which loads through accelerate)."""
    return _python("lmql0.7.3-server-torch2.13.0", [*REQUIREMENTS, "accelerate"])
