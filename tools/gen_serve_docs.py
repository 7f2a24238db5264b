"""Render docs/serve.md from `salience serve`'s parser (`.venv/bin/python -m tools.gen_serve_docs`).

The help strings in salience/cli/serve_flags.py and engine_flags.py are the one description of
the flags; this lays them out as one table per argument group, and tests/test_cli_docs.py checks
that the checked-in file is what it renders.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "serve.md"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """A parser's subcommands by name ({} when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def serve_parser() -> argparse.ArgumentParser:
    from salience.cli import _parser

    return subcommands(_parser())["serve"]


def _markdown(text: str) -> str:
    """Help text as markdown: --flags and $VARIABLES as code, docs/NAME.md#anchor as a link from docs/."""
    text = re.sub(r"(?<![\w-])(--[a-z][a-z0-9-]*|\$[A-Z_]+)", r"`\1`", text)
    text = re.sub(r"docs/([\w-]+\.md)(#[\w-]+)?", r"[docs/\1](\1\2)", text)
    return text.replace("|", "\\|")


def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    flags = " / ".join(f"`{flag}`" for flag in action.option_strings)
    if action.nargs != 0:
        metavar = action.metavar or ("{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper())
        flags = f"{flags[:-1]} {metavar}`"
    help_text = parser._get_formatter()._expand_help(action)  # %(default)s filled in, as --help prints it
    description, _, default = help_text.rpartition(" (default: ")
    if not description:
        description, default = help_text, ""
    return f"| {flags} | {_markdown(default.removesuffix(')'))} | {_markdown(description)} |"


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or serve_parser()
    lines = [
        "# `salience serve`",
        "",
        "<!-- Generated from the help strings in salience/cli/serve_flags.py and engine_flags.py by "
        "tools/gen_serve_docs.py; edit those and run `.venv/bin/python -m tools.gen_serve_docs`. -->",
        "",
        _markdown(parser.description or ""),
        "",
        "Every flag, in the groups `salience serve --help` prints them in:",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines += ["", f"## {group.title}", ""]
        if group.description:
            lines += [_markdown(group.description), ""]
        lines += ["| flag | default | description |", "|---|---|---|"]
        lines += [_row(parser, action) for action in actions]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    DOC.write_text(render())
