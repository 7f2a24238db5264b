"""`salience patch`: a causal-tracing sweep on a running server (docs/patching.md). The texts are
tokenized by the server; the grid is printed as the share of the clean run's metric each patch
restores, and drawn as a PNG with --png."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from salience.core.models.points import POINTS
from salience.errors import InvalidArgument
from salience.tls import ClientTls

__all__ = ["add_patch_parser", "run_patch"]


def add_patch_parser(commands: argparse._SubParsersAction, add_client_flags: Callable) -> None:
    patch = commands.add_parser(
        "patch",
        help="causal tracing on a running server: which layers and positions carry the answer",
        description="Run the corrupted prompt once per point x layer x position with the clean run's activation "
        "put back, and print how much of the answer each restores (0: the corrupted run, 1: the clean).",
    )
    patch.add_argument("clean", help="the clean prompt")
    patch.add_argument("--corrupted", required=True, help="the corrupted prompt (as many tokens as the clean one)")
    patch.add_argument("--answer", required=True, help="the answer the clean prompt leads to, e.g. ' Paris'")
    patch.add_argument("--foil", help="a wrong answer: the metric is then the logit difference answer - foil")
    patch.add_argument(
        "--points", default="resid_pre", help=f"hook points to sweep, comma-separated ({', '.join(POINTS)})"
    )
    patch.add_argument("--layers", default="", help="layers to sweep, e.g. 0-11 or 3,5 (default: every layer)")
    patch.add_argument("--png", type=Path, metavar="FILE", help="also draw the grid as a heatmap into FILE")
    patch.add_argument("--url", default="ws://127.0.0.1:8080/", help="LMTP WebSocket URL (wss:// for TLS)")
    add_client_flags(patch)


async def run_patch(args: argparse.Namespace, tls: ClientTls) -> int:
    """Tokenize on the server, sweep, print the grid (and draw it with --png); 0 on success."""
    from salience.cli.heatmap import write_heatmap
    from salience.lmtp.client import LmtpClient

    headers = {"Authorization": f"Bearer {args.token}"} if args.token else None
    client = await LmtpClient.connect(args.url, headers, tls=tls.context() if args.url.startswith("wss:") else None)
    try:
        clean = (await client.request("TOKENIZE", text=args.clean, add_special_tokens=True))["tokens"]
        corrupted = (await client.request("TOKENIZE", text=args.corrupted, add_special_tokens=True))["tokens"]
        answer = (await client.request("TOKENIZE", text=args.answer, add_special_tokens=False))["tokens"]
        fields = {
            "clean": clean,
            "corrupted": corrupted,
            "answer": answer,
            "points": [p.strip() for p in args.points.split(",") if p.strip()],
            "layers": _layers(args.layers),
        }
        if args.foil:
            fields["foil"] = (await client.request("TOKENIZE", text=args.foil, add_special_tokens=False))["tokens"]
            fields["metric"] = "logit_diff"
        grid = await client.sweep(progress=_progress, **fields)
        print(file=sys.stderr)
        labels = [(await client.request("DETOKENIZE", tokens=[t]))["text"] for t in clean]
    finally:
        await client.close()
    span = grid["clean"] - grid["corrupted"]
    panels = {
        point: [[(v - grid["corrupted"]) / span if span else 0.0 for v in row] for row in values]
        for point, values in grid["grid"].items()
    }
    metric = "logit difference" if args.foil else "answer logprob"
    print(f"{metric}: clean {grid['clean']:.4f}, corrupted {grid['corrupted']:.4f}; share restored per cell:")
    for point, rows in panels.items():
        print(f"\n{point}  (layer down, token across)")
        print("      " + " ".join(f"{_short(label):>6}" for label in labels))
        for layer, row in zip(grid["layers"], rows, strict=True):
            print(f"{layer:>5} " + " ".join(f"{share:6.2f}" for share in row))
    if args.png:
        write_heatmap(args.png, panels, grid["layers"], labels, f"{metric} restored: {args.clean!r} -> {args.answer!r}")
        print(f"\nheatmap: {args.png}")
    return 0


def _layers(text: str) -> list[int]:
    layers: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, dash, last = part.partition("-")
        try:
            layers.extend(range(int(first), int(last) + 1) if dash else [int(first)])
        except ValueError:
            raise InvalidArgument(f"--layers: {part!r} is not a layer or a range of layers") from None
    return layers


def _short(label: str) -> str:
    return label.replace("\n", "\\n")[:6]


def _progress(done: int, total: int) -> None:
    print(f"\rpatched runs: {done}/{total}", end="", file=sys.stderr, flush=True)
