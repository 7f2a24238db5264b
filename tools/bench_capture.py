"""Residual capture: `salience capture` in-process against transformers the way people do it today.

Both sides read the same documents (docstrings of Python's standard library, which every machine
with Python has) and the same layers of the default model, in float32:

- transformers: AutoModelForCausalLM, right-padded batches of --batch documents,
  `output_hidden_states=True`, each document's real tokens' rows copied out to numpy;
- Salience: `salience.capture` through the compiled engine in this process (prefill-only requests
  asking for residual rows, --batch at a time), shards written to a temporary folder.

Both are loaded once; the runs alternate (which goes first alternates too), and the median of
--repeats gives tokens/s and the ratio.

    .venv/bin/python -m tools.bench_capture [--documents 256] [--layers 15] [--batch 16] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as `python tools/bench_capture.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.home import configure_environment
from salience.logs import setup_logging

configure_environment()  # before torch and vLLM are imported: their caches live under $SALIENCE_HOME
setup_logging()  # and vLLM's processes log quietly

import torch  # noqa: E402

from tools.harness import Report, arguments, rotations, say  # noqa: E402


def stdlib_documents(count: int, max_chars: int = 2000) -> list[str]:
    """Module and function docstrings of the standard library, longest first up to `count`."""
    texts: list[str] = []
    for module in sorted(sys.stdlib_module_names):
        if module.startswith("_") or module in {"antigravity", "this", "idlelib", "tkinter", "turtle"}:
            continue
        try:
            loaded = importlib.import_module(module)
        except Exception:  # platform modules that do not import here
            continue
        for _, member in inspect.getmembers(loaded):
            doc = inspect.getdoc(member) if callable(member) or inspect.ismodule(member) else None
            if doc and len(doc) > 200:
                texts.append(doc[:max_chars])
    texts = sorted(dict.fromkeys(texts), key=len, reverse=True)
    return texts[:count]


def transformers_capture(model, tokenizer, texts: list[str], layers: list[int], batch: int) -> int:
    """Rows of every real token at `layers`, as numpy; returns the tokens captured."""
    tokens = 0
    for start in range(0, len(texts), batch):
        encoded = tokenizer(texts[start : start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model(**encoded, output_hidden_states=True)
        mask = encoded["attention_mask"].bool()
        for layer in layers:
            rows = out.hidden_states[layer + 1][mask].numpy().copy()  # output of decoder layer `layer`
        tokens += int(mask.sum())
        del rows
    return tokens


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--documents", type=int, default=256)
    parser.add_argument("--layers", default="15")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from salience.capture.run import CaptureOptions, capture, parse_layers
    from salience.capture.sources import EngineSource
    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    model_dir = ensure_default_model()
    layers = parse_layers(args.layers)
    texts = stdlib_documents(args.documents)
    say(f"{len(texts)} documents, layers {list(layers)}; loading both sides")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    source = await EngineSource.start(model_dir, layers, max_model_len=2048)
    report = Report("bench_capture", args)
    try:
        with tempfile.TemporaryDirectory() as folder:
            corpus = Path(folder) / "corpus.jsonl"
            corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
            options = CaptureOptions(layers=layers, batch=args.batch, shard_tokens=1 << 20)
            await capture(corpus, Path(folder) / "warm", source, DEFAULT_MODEL_NAME, options)  # warm-up
            transformers_capture(hf, tokenizer, texts[: args.batch], list(layers), args.batch)
            for repeat, side in rotations(["transformers", "salience capture"], args.repeats):
                started = time.perf_counter()
                if side == "transformers":
                    tokens = transformers_capture(hf, tokenizer, texts, list(layers), args.batch)
                else:
                    out = Path(folder) / f"run{repeat}"
                    tokens = (await capture(corpus, out, source, DEFAULT_MODEL_NAME, options)).tokens_done
                rate = tokens / (time.perf_counter() - started)
                report.samples.add(f"{side} {rate:.0f} tok/s", {f"{side} tok/s": rate})
    finally:
        await source.close()
    hf_rate, ours = (report.samples.median(f"{side} tok/s") for side in ("transformers", "salience capture"))
    table = report.table(
        f"{DEFAULT_MODEL_NAME}, {len(texts)} stdlib docstrings, layers {list(layers)}, float32, "
        f"batches of {args.batch}, median of {args.repeats}",
        ("", ""),
        ("tokens/s", "{:.0f}"),
        ("ratio", "{:.2f}"),
    )
    table.add("transformers, padded batches, output_hidden_states", hf_rate, 1.0)
    table.add("salience capture (compiled engine, shards written)", ours, ours / hf_rate)
    report.emit()


if __name__ == "__main__":
    asyncio.run(main())
