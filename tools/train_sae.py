"""Train a top-k sparse autoencoder for the default model, from text every machine already has.

    .venv/bin/python tools/train_sae.py -o OUT [--layer 15] [--tokens 300000] [--expansion 8] [--k 32]
                                        [--epochs 4] [--seed 0] [--stop-after corpus|capture|train] [--threads 2]

Four stages, each skipped when its output is complete, so a rerun resumes where one stopped:

1. Corpus (`OUT/corpus.jsonl`, `OUT/heldout.jsonl`, `OUT/corpus.json`). Provenance: the
   docstrings of Python's own standard library (`sysconfig.get_paths()["stdlib"]`, test
   directories skipped): English prose about programs with code in between, the register a
   served model sees, and present on any machine without a network. Module, class and function
   docstrings (`ast.get_docstring`) of at least 200 characters, trailing blanks and blank runs
   removed, exact duplicates dropped, each cut at paragraph breaks into pieces of about 1,000
   characters (~256 tokens) so that a long docstring is not lost to the per-document cut; ids are
   `path:qualname` (`#n` for the n-th piece). A docstring is held out when a hash of its id says so
   (1 in 20), so pieces of one docstring never straddle the split. Documents are ordered by a hash
   of their id, so the first N tokens sample the whole library rather than its first letters, and
   the corpus holds just enough of them for `--tokens` (held out: 1/19 of that). Python 3.11's
   library gives about 320K training tokens; past that Debian's `/usr/share/common-licenses` is
   added, if present.
2. Capture (`OUT/capture/`, `OUT/heldout/`): `salience.capture` in this process through the
   serving engine (compiled, a tap at `--layer` only), so the rows are exactly what readouts see:
   the residual stream after the layer, float32. Layer 15 of 30: the middle, where features are
   most abstract. The first position of each document is left out (an attention sink, orders of
   magnitude larger than the rest); documents are cut at 256 tokens. The default 300K tokens take
   six minutes at ~850 tokens/s. Capture resumes by itself. Only this stage starts vLLM:
   `--stop-after capture` runs the stages up to it alone, e.g. under a lock.
3. Train (tools/sae_training.py, where each choice is explained): width 8 x 576 = 4608, k = 32,
   the recipe of Gao et al. 2024 with AuxK against dead latents, in plain torch on two CPU cores.
   A few positions past the first are attention sinks too (29 of the 300K training rows, 2 of the
   16K held out, mostly position 1, with norms up to 130x the median): with them the held-out
   variance is three quarters theirs, so rows with a norm above 3x the median are left out of
   training and of the FVE, and counted in the report (with the FVE they would give).
4. Report (`OUT/report.json`, printed): on the held-out documents' tokens, the fraction of
   variance explained (1 - sum ||x - x̂||² / sum ||x - mean x||²), mean L0, and dead latents: those
   that fired neither on the held-out tokens nor in the last `dead_tokens` rows of training. The
   goal is FVE >= 0.7 with fewer than 20% dead.

The default run, on two cores: corpus 9 s, capture 7 min (the engine's start included; about
9 min when the cores are shared with other work), training and report 80 s (2-4x that when
shared; `--threads 1` helps then). Held-out: FVE 0.852, 0.1% dead (1.2% on the held-out tokens
alone), L0 32.

The SAE is saved with `salience.core.features.sae.save_sae` to `OUT/sae/` (serve it with
`salience serve --sae OUT/sae`), in raw activation units: the input scaling used in training is
folded into the biases, so the server needs no normalisation; the folder is loaded back with
`load_sae` and checked against the trained model before the report is written.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import hashlib
import json
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds `tools`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from salience.core.models.home import configure_environment
from salience.logs import setup_logging

configure_environment()  # before torch and vLLM are imported: their caches live under $SALIENCE_HOME
setup_logging("warning")

import torch  # noqa: E402

from tools.sae_training import TrainConfig, evaluate, train  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"
MIN_CHARS = 200
PIECE_CHARS = 1000
HELDOUT_ONE_IN = 20
MAX_TOKENS_PER_DOC = 256
OUTLIER_MEDIANS = 3  # rows with a norm above 3x the median are attention sinks (see `ordinary`)
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def clean(text: str) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def pieces(text: str) -> list[str]:
    """`text` cut at paragraph breaks into pieces of about PIECE_CHARS; a short tail joins the last."""
    out: list[str] = []
    for paragraph in text.split("\n\n"):
        if out and len(out[-1]) + len(paragraph) + 2 <= PIECE_CHARS:
            out[-1] += "\n\n" + paragraph
        else:
            out.append(paragraph)
    if len(out) > 1 and len(out[-1]) < MIN_CHARS:
        tail = out.pop()
        out[-1] += "\n\n" + tail
    return out


def _docstrings(tree: ast.AST, prefix: str):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}.{node.name}" if prefix else node.name
            yield name, ast.get_docstring(node)
            yield from _docstrings(node, name)


def stdlib_docstrings(root: Path) -> list[tuple[str, str]]:
    """(id, text) of the standard library's docstrings in a fixed order: files sorted, then the tree."""
    found: list[tuple[str, str]] = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = Path(folder) / name
            try:
                tree = ast.parse(path.read_bytes(), filename=str(path))
            except (SyntaxError, ValueError, OSError):  # lib2to3 fixtures and the like
                continue
            relative = path.relative_to(root).as_posix()
            found.append((relative, ast.get_docstring(tree)))
            found.extend((f"{relative}:{qualname}", doc) for qualname, doc in _docstrings(tree, ""))
    return [(doc_id, clean(doc)) for doc_id, doc in found if doc and len(doc.strip()) >= MIN_CHARS]


def license_texts(root: Path = Path("/usr/share/common-licenses")) -> list[tuple[str, str]]:
    if not root.is_dir():
        return []
    paths = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink())
    return [(f"common-licenses/{p.name}", clean(p.read_text(errors="replace"))) for p in paths]


def documents(source: list[tuple[str, str]], seen: set[str]) -> tuple[list[dict], list[dict]]:
    """Deduplicated pieces, ordered by a hash of their id, as (training, held out)."""
    train_docs, heldout_docs = [], []
    for doc_id, text in source:
        if text in seen:
            continue
        seen.add(text)
        side = heldout_docs if _hash("heldout:" + doc_id) % HELDOUT_ONE_IN == 0 else train_docs
        for number, piece in enumerate(pieces(text)):
            side.append({"id": doc_id if number == 0 else f"{doc_id}#{number}", "text": piece})
    order = lambda doc: _hash(doc["id"])  # noqa: E731
    return sorted(train_docs, key=order), sorted(heldout_docs, key=order)


def build_corpus(out: Path, tokens: int, tokenizer) -> dict:
    def counted(docs: list[dict]) -> list[int]:  # the rows each document gives: first position dropped
        ids = tokenizer([d["text"] for d in docs], add_special_tokens=False)["input_ids"]
        return [max(0, min(len(i), MAX_TOKENS_PER_DOC) - 1) for i in ids]

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    budgets = {"train": tokens, "heldout": tokens // (HELDOUT_ONE_IN - 1)}
    chosen: dict[str, list[dict]] = {"train": [], "heldout": []}
    totals = {"train": 0, "heldout": 0}
    sources = []
    available = [
        (f"Python {sys.version.split()[0]} stdlib docstrings", lambda: stdlib_docstrings(stdlib)),
        ("/usr/share/common-licenses", license_texts),  # only when the library falls short of --tokens
    ]
    for name, source in available:
        if all(totals[s] >= budgets[s] for s in totals):
            break
        sources.append(name)
        for side, docs in zip(("train", "heldout"), documents(source(), seen), strict=True):
            for doc, count in zip(docs, counted(docs), strict=True):
                if totals[side] >= budgets[side]:
                    break
                if count:
                    chosen[side].append(doc)
                    totals[side] += count
    for side, name in (("train", "corpus.jsonl"), ("heldout", "heldout.jsonl")):
        text = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in chosen[side])
        (out / name).with_suffix(".partial").write_text(text, encoding="utf-8")
        (out / name).with_suffix(".partial").replace(out / name)
    if totals["train"] < budgets["train"]:
        print(f"note: the corpus holds {totals['train']} training tokens, fewer than --tokens {tokens}")
    return {"sources": sources, "documents": {s: len(d) for s, d in chosen.items()}, "tokens": totals}


def _manifest_done(folder: Path, layer: int) -> bool:
    """A finished capture of `layer` (one of other options is left to `capture` to refuse)."""
    manifest = folder / "manifest.json"
    saved = json.loads(manifest.read_text()) if manifest.exists() else {}
    return saved.get("done", False) and saved.get("layers") == [layer]


async def capture_both(out: Path, model: Path, layer: int) -> None:
    from salience.capture.run import CaptureOptions, capture
    from salience.capture.sources import EngineSource

    options = CaptureOptions(layers=(layer,), drop_first=True, max_tokens_per_document=MAX_TOKENS_PER_DOC)
    source = await EngineSource.start(model, options.layers, max_model_len=4096)
    try:
        for corpus, folder in (("corpus.jsonl", "capture"), ("heldout.jsonl", "heldout")):
            await capture(out / corpus, out / folder, source, MODEL_NAME, options)
    finally:
        await source.close()


def load_rows(folder: Path, layer: int) -> torch.Tensor:
    from safetensors.torch import load_file

    manifest = json.loads((folder / "manifest.json").read_text())
    return torch.cat([load_file(folder / s["file"])[f"layer.{layer}"].float() for s in manifest["shards"]])


def ordinary(rows: torch.Tensor, limit: float) -> torch.Tensor:
    """The rows whose norm is at most `limit`: a few positions past the first are attention sinks
    too, with norms up to 100x the median, and would otherwise carry most of the variance."""
    return rows[rows.norm(dim=1) <= limit]


def report_table(report: dict) -> str:
    held = report["heldout"]
    return "\n".join(
        [
            f"held-out: {held['tokens']} tokens of {held['documents']} documents "
            f"({held['outliers']} attention-sink rows left out; FVE with them: {held['fve_with_outliers']:.3f})",
            "| FVE | dead | dead on held-out alone | mean L0 |",
            "|---:|---:|---:|---:|",
            f"| {held['fve']:.3f} | {held['dead_fraction']:.1%} | {held['dead_heldout_only']:.1%} | {held['l0']:.1f} |",
        ]
    )


def train_and_report(out: Path, args: argparse.Namespace, config: TrainConfig, corpus: dict) -> dict:
    from salience.core.features.sae import load_sae, save_sae

    captured, heldout_all = load_rows(out / "capture", args.layer), load_rows(out / "heldout", args.layer)
    limit = OUTLIER_MEDIANS * captured.norm(dim=1).median().item()
    x, heldout = ordinary(captured, limit), ordinary(heldout_all, limit)
    print(f"training on {x.shape[0]} rows of layer {args.layer} ({x.shape[1]} wide), {config.epochs} epochs")
    result = train(x, config)
    metrics = evaluate(result.sae, heldout)
    dead = ~(metrics.fired | result.alive)
    report = {
        "settings": _train_settings(args),
        "heldout": {
            "tokens": metrics.rows,
            "documents": corpus["documents"]["heldout"],
            "fve": metrics.fve,
            "l0": metrics.l0,
            "dead_fraction": dead.float().mean().item(),
            "dead_heldout_only": metrics.dead_fraction,
            "dead_definition": f"fired neither on the held-out tokens nor in the last {config.dead_tokens} "
            "training rows",
            "outliers": heldout_all.shape[0] - heldout.shape[0],
            "fve_with_outliers": evaluate(result.sae, heldout_all).fve,
        },
        "train": {
            "tokens": x.shape[0],
            "documents": corpus["documents"]["train"],
            "outliers": captured.shape[0] - x.shape[0],
            "outlier_rule": f"norm > {OUTLIER_MEDIANS} x the median training row norm ({limit:.1f})",
            "fve_last_epoch": result.train_fve,
            "steps": result.steps,
            "rows_seen": result.tokens,
            "seconds": round(result.seconds, 1),
            "input_scale": result.scale,
            "config": dict(config.__dict__),
        },
        "corpus": corpus,
    }
    sae = result.sae
    save_sae(
        out / "sae",
        architecture="topk",
        layer=args.layer,
        W_enc=sae.W_enc,
        b_enc=sae.b_enc,
        W_dec=sae.W_dec,
        b_dec=sae.b_dec,
        k=config.k,
        model_name=MODEL_NAME,
        extra_metadata={
            "prepend_bos": False,  # the capture tokenizes without special tokens
            "trained_by": "tools/train_sae.py",
            "training": report["train"],
            "heldout": report["heldout"],
            "corpus_sources": corpus["sources"],
            "capture": {"drop_first": True, "max_tokens_per_document": MAX_TOKENS_PER_DOC, "dtype": "float32"},
        },
    )
    served, sample = load_sae(out / "sae"), heldout[:1024]  # what the server will compute
    torch.testing.assert_close(served.encode(sample), sae.latents(sample), rtol=1e-4, atol=1e-3)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _train_settings(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("layer", "tokens", "expansion", "k", "epochs", "seed")}


def main() -> int:
    from salience.errors import SalienceError

    try:
        return run()
    except SalienceError as exc:  # a capture folder made otherwise, a layer the model lacks
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, required=True, help="the folder for every stage's output")
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=300_000, help="training tokens to capture")
    parser.add_argument("--expansion", type=int, default=8, help="d_sae = expansion x hidden size")
    parser.add_argument("--k", type=int, default=32, help="active latents per token")
    parser.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-after", choices=["corpus", "capture", "train"], default="train")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for training (1 on a busy machine)")
    args = parser.parse_args()
    out: Path = args.output.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    from salience.core.models.default_model import ensure_default_model

    model = ensure_default_model()
    stage_started = time.monotonic()

    wanted = {"tokens": args.tokens, "max_tokens_per_document": MAX_TOKENS_PER_DOC, "python": sys.version.split()[0]}
    corpus_file = out / "corpus.json"
    corpus = json.loads(corpus_file.read_text()) if corpus_file.exists() else None
    if corpus is not None and corpus["settings"] != wanted:
        print(f"error: {out} holds a corpus made with {corpus['settings']}: use another -o", file=sys.stderr)
        return 2
    if corpus is None:
        from transformers import AutoTokenizer

        corpus = {"settings": wanted, **build_corpus(out, args.tokens, AutoTokenizer.from_pretrained(str(model)))}
        corpus_file.write_text(json.dumps(corpus, indent=1) + "\n")
        took = time.monotonic() - stage_started
        print(f"corpus: {corpus['documents']} documents, {corpus['tokens']} tokens ({took:.0f} s)")
    if args.stop_after == "corpus":
        return 0

    if not (_manifest_done(out / "capture", args.layer) and _manifest_done(out / "heldout", args.layer)):
        started = time.monotonic()
        asyncio.run(capture_both(out, model, args.layer))
        print(f"capture: {time.monotonic() - started:.0f} s")
    if args.stop_after == "capture":
        return 0

    report_file = out / "report.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else None
    if report is None or report["settings"] != _train_settings(args) or not (out / "sae").is_dir():
        started = time.monotonic()
        config = TrainConfig(expansion=args.expansion, k=args.k, epochs=args.epochs, seed=args.seed)
        report = train_and_report(out, args, config, corpus)
        print(f"train and report: {time.monotonic() - started:.0f} s")
    print(report_table(report))
    print(f"SAE: {out / 'sae'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
