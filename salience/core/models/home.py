"""Where Salience and the libraries under it keep their caches.

vLLM and torch write compile caches and IPC sockets to places of their own
(~/.cache/vllm, /tmp/torchinductor_*, the temp dir). Pointing them all under
SALIENCE_HOME keeps one directory to inspect or delete, and must happen before
vllm or torch is imported, so `configure_environment` runs at CLI start and in
tests' conftest.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["configure_environment", "salience_home"]


def salience_home() -> Path:
    return Path(os.environ.get("SALIENCE_HOME") or Path.home() / ".cache" / "salience").expanduser()


def configure_environment() -> Path:
    """Route every library cache under SALIENCE_HOME; explicit settings win."""
    home = salience_home()
    home.mkdir(parents=True, exist_ok=True)
    ipc = home / "ipc"
    ipc.mkdir(exist_ok=True)
    tmp = home / "tmp"
    tmp.mkdir(exist_ok=True)
    defaults = {
        # torch writes precompiled headers (150 MB) to <tempdir>/torchinductor_<user>
        # whatever TORCHINDUCTOR_CACHE_DIR says.
        "TMPDIR": tmp,
        "VLLM_CACHE_ROOT": home / "vllm",
        "VLLM_CONFIG_ROOT": home / "vllm-config",
        "VLLM_RPC_BASE_PATH": ipc,
        "TORCHINDUCTOR_CACHE_DIR": home / "torchinductor",
        "TRITON_CACHE_DIR": home / "triton",
        "TORCH_EXTENSIONS_DIR": home / "torch-extensions",
        "HF_HOME": home / "huggingface",
        # No hub is reachable: never try.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, str(value))
    tempfile.tempdir = None  # forget a temp dir chosen before TMPDIR was set
    return home
