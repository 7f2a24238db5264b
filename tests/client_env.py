"""A separate virtualenv with what LMQL users run: lmql 0.7.3 and transformers 4.x.

LMQL's client tokenizes on its side with transformers < 5, which cannot share the
server's environment (vLLM needs 5.x). Built once per cache, atomically.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

from salience.core.atomic import build_folder_once
from salience.core.home import salience_home

REQUIREMENTS = ["lmql==0.7.3", "transformers==4.57.6"]


def _build(folder: Path) -> None:
    venv.EnvBuilder(with_pip=True).create(folder)
    subprocess.run(
        [folder / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", *REQUIREMENTS],
        check=True,
        stdout=sys.stderr,
    )


def client_python() -> Path:
    """The Python of the LMQL client environment (a moved venv still runs by its interpreter)."""
    key = "-".join(r.replace("==", "") for r in REQUIREMENTS)
    return build_folder_once(salience_home() / "venvs" / key, _build) / "bin" / "python"
