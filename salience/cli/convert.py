"""`salience convert`: a GGUF file (as PyPI wheels ship models) into a folder `serve --model` takes."""

from __future__ import annotations

import argparse
from pathlib import Path

from salience.errors import InvalidArgument

__all__ = ["add_convert_parser", "run_convert"]


def add_convert_parser(commands: argparse._SubParsersAction) -> None:
    convert = commands.add_parser(
        "convert", help="dequantize a GGUF model into a float32 Hugging Face folder (docs/models.md)"
    )
    convert.add_argument("gguf", type=Path, metavar="GGUF", help="the .gguf file")
    convert.add_argument("out", type=Path, metavar="DIR", help="the folder to write (must not exist yet)")


def run_convert(args: argparse.Namespace) -> int:
    from salience.core.models.atomic import build_folder_once
    from salience.core.models.folders import inspect_model_folder
    from salience.core.models.gguf_folder import convert_gguf

    if not args.gguf.is_file():
        raise InvalidArgument(f"{args.gguf}: no such GGUF file")
    if args.out.exists():
        raise InvalidArgument(f"{args.out} exists: name a new folder")
    build_folder_once(args.out, lambda out: convert_gguf(args.gguf, out, name=args.gguf.stem))
    inspect_model_folder(args.out)  # what serve checks first: the architecture is one it serves
    print(f"converted into {args.out}; serve it with: salience serve --model {args.out}")
    return 0
