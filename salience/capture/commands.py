"""The command line's faces of a capture: `salience capture` writes one, and `salience features top
ID` reads one through an SAE to show what a feature means (the tokens it fires most on). Kept out
of salience.cli, which only registers these parsers and dispatches here."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from salience.auth import AUTH_TOKEN_ENV, token_from_environment
from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.capture.feature_tops import FeatureHit, FeatureReport
    from salience.capture.sources import Source

__all__ = [
    "add_capture_parsers",
    "format_hit",
    "format_table",
    "hit_json",
    "run_capture",
    "run_features",
    "start_source",
]

Decode = Callable[[Sequence[int]], str]


def add_capture_parsers(commands: argparse._SubParsersAction) -> None:
    capture = commands.add_parser(
        "capture", help="run a corpus through the engine and write residual activations to shards"
    )
    capture.add_argument("corpus", type=Path, help="text lines, or JSONL with a text (and id) per line")
    capture.add_argument("--layers", required=True, help="layers to capture: 15, 10,20 or 8-12")
    capture.add_argument("-o", "--output", type=Path, required=True, help="folder for the shards (resumed if present)")
    capture.add_argument("--model", type=Path, help="model folder (default: the embedded model)")
    capture.add_argument("--server", help="capture through a running server's gRPC (HOST:PORT) instead")
    capture.add_argument("--token", default=token_from_environment(), help=f"the server's token (${AUTH_TOKEN_ENV})")
    capture.add_argument("--drop-first", action="store_true", help="leave each document's first position out")
    capture.add_argument("--max-tokens-per-doc", type=int, help="cut documents there (always cut to the context)")
    capture.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    capture.add_argument("--shard-tokens", type=int, default=65536)
    capture.add_argument("--batch", type=int, default=16, help="documents at a time")
    capture.add_argument(
        "--max-model-len", type=int, help="the engine's context in tokens (default: the model's own); in-process only"
    )
    capture.add_argument("--eager", dest="compile", action="store_false", help="no compiled graph (starts sooner)")

    features = commands.add_parser("features", help="inspect sparse-autoencoder features").add_subparsers(
        dest="features_command", required=True
    )
    top = features.add_parser("top", help="the tokens of a capture where a feature fires most, in context")
    top.add_argument("feature", type=int, metavar="ID", help="the feature's index in the SAE")
    top.add_argument("--sae", type=Path, required=True, help="SAE folder (SAELens format)")
    top.add_argument("--capture", type=Path, required=True, help="folder `salience capture` wrote")
    top.add_argument("--count", type=int, default=20, help="hits to show")
    top.add_argument("--context", type=int, default=8, help="tokens shown before each hit (half as many after)")
    top.add_argument("--model", type=Path, help="model folder to decode with (default: the capture's model)")
    top.add_argument("--json", action="store_true", help="one JSON object per hit (the summary goes to stderr)")


async def run_capture(args: argparse.Namespace) -> int:
    from salience.capture.run import CaptureOptions, capture, parse_layers
    from salience.core.models.default_model import ensure_default_model
    from salience.core.models.folders import inspect_model_folder

    options = CaptureOptions(
        layers=parse_layers(args.layers),
        drop_first=args.drop_first,
        max_tokens_per_document=args.max_tokens_per_doc,
        dtype=args.dtype,
        shard_tokens=args.shard_tokens,
        batch=args.batch,
    )
    model = inspect_model_folder(args.model or ensure_default_model()).path
    source = await start_source(args, model, options.layers)
    try:
        writer = await capture(args.corpus, args.output, source, model.name, options)
    finally:
        await source.close()
    shards = len(writer.shards)
    print(f"{writer.tokens_done} tokens of {writer.documents_done} documents in {shards} shards: {args.output}")
    return 0


async def start_source(args: argparse.Namespace, model: Path, layers: Sequence[int]) -> Source:
    """A running server's rows over gRPC (`--server`), or an engine started here: with the model's
    own context unless `--max-model-len` asks for less (a fixed default fails on a shorter model)."""
    from salience.capture.sources import EngineSource, GrpcSource

    if args.server:
        return await GrpcSource.connect(args.server, args.token, model)
    return await EngineSource.start(model, layers, args.max_model_len, compile=args.compile)


def run_features(args: argparse.Namespace) -> int:
    from salience.capture.feature_tops import feature_report
    from salience.core.features.sae import load_sae

    sae = load_sae(args.sae)
    report = feature_report(args.capture, sae, args.feature, count=args.count, context=args.context)
    decode = _decoder(_tokenizer_folder(args.capture, args.model))
    summary = _summary(report, args.capture)
    if args.json:
        for rank, hit in enumerate(report.hits, 1):
            print(json.dumps(hit_json(rank, hit, decode), ensure_ascii=False))
        print(summary, file=sys.stderr)
    else:
        print(summary)
        print(format_table(report, decode))
    return 0


def hit_json(rank: int, hit: FeatureHit, decode: Decode) -> dict:
    return {
        "rank": rank,
        "activation": hit.activation,
        "document": hit.document,
        "id": hit.document_id,
        "position": hit.position,
        "token_id": hit.token_id,
        "token": decode([hit.token_id]),
        "before": decode(hit.before),
        "after": decode(hit.after),
        "before_ids": list(hit.before),
        "after_ids": list(hit.after),
    }


def format_hit(hit: FeatureHit, decode: Decode, *, context: int, after: int) -> str:
    """`…the quick [[brown]] fox…` on one line: the token's leading space stays outside the marks,
    and an ellipsis says the document goes on past the context shown."""
    token = decode([hit.token_id])
    word = token.lstrip(" ") or token  # a token of spaces only stays whole inside the marks
    before = ("…" if context and len(hit.before) == context else "") + decode(hit.before)
    text = f"{before}{token[: len(token) - len(word)]}[[{word}]]{decode(hit.after)}"
    text = text.replace("\r", "").replace("\n", "⏎").replace("\t", " ")
    return text + ("…" if after and len(hit.after) == after else "")


def format_table(report: FeatureReport, decode: Decode) -> str:
    if not report.hits:
        return f"feature {report.feature} never fired on these {report.tokens_seen} tokens"
    ids = [hit.document_id for hit in report.hits]
    width = max(8, *(len(i) for i in ids))
    lines = [f"{'rank':>4}  {'activation':>10}  {'document':<{width}}  text"]
    for rank, hit in enumerate(report.hits, 1):
        text = format_hit(hit, decode, context=report.context, after=report.after)
        lines.append(f"{rank:>4}  {hit.activation:>10.4f}  {hit.document_id:<{width}}  {text}")
    return "\n".join(lines)


def _summary(report: FeatureReport, capture: Path) -> str:
    state = "" if report.complete else ", an unfinished capture: what it held so far"
    return (
        f"feature {report.feature} at layer {report.layer} in {capture}: fired on {report.fired:,} of "
        f"{report.tokens_seen:,} tokens ({report.density:.3%}), max {report.max_activation:.4f} "
        f"({report.documents_seen:,} documents in {report.shards_read} shards{state})"
    )


def _tokenizer_folder(capture: Path, model: Path | None) -> Path:
    """The folder to decode with: --model, else the capture's model (its name, or a path), else the
    default model the way `salience capture` finds it."""
    if model is not None:
        return model
    name = json.loads((capture / "manifest.json").read_text()).get("model", "")
    if name and Path(name).is_dir():
        return Path(name)
    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

    if name.startswith(DEFAULT_MODEL_NAME):  # the name, or its converted folder's (…-f32-v2)
        return ensure_default_model()
    raise InvalidArgument(f"the capture's model is {name!r}, not a folder here: name its folder with --model")


def _decoder(folder: Path) -> Decode:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False)
