"""The docs against the command line's parsers, read without starting anything: docs/serve.md is what
tools/gen_serve_docs.py renders from `salience serve`'s help strings, and every flag the README names
is one a parser has."""

from __future__ import annotations

import argparse
import ast
import re

from salience.cli import _parser
from tools.gen_serve_docs import DOC, ROOT, render, serve_parser, subcommands

README = ROOT / "README.md"
FLAG = re.compile(r"(?<![\w-])--?[a-zA-Z][\w-]*")
# Flags of other programs (pytest's, pip's) the README may quote, e.g. in `make test ARGS="..."`.
OTHER_PROGRAMS: set[str] = set()


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _every_option(parser: argparse.ArgumentParser) -> set[str]:
    return _options(parser).union(*(_every_option(sub) for sub in subcommands(parser).values()))


def _tool_options() -> set[str]:
    """The flags tools/'s scripts add to their own parsers (the README quotes the benchmarks' runs)."""
    found = set()
    for path in (ROOT / "tools").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                found |= {arg.value for arg in node.args if isinstance(arg, ast.Constant) and arg.value[:2] == "--"}
    return found


def _code(text: str) -> list[str]:
    """The README's code: each line of a fenced block, each inline span."""
    snippets = []
    for i, part in enumerate(text.split("```")):
        snippets += part.splitlines() if i % 2 else re.findall(r"`([^`]+)`", part)
    return snippets


def _invocation(snippet: str) -> tuple[str, argparse.ArgumentParser, str] | None:
    """A `salience ...` command line's subcommand, its parser and the rest of the line; `make serve
    ARGS="..."` counts as `salience serve`."""
    if make := re.search(r'make serve ARGS="([^"]*)"', snippet):
        return "salience serve", serve_parser(), make.group(1)
    words = snippet.split(" #")[0].split()
    start = next((i for i, word in enumerate(words) if word == "salience" or word.endswith("/salience")), None)
    if start is None:
        return None
    parser, command, rest = _parser(), ["salience"], words[start + 1 :]
    while rest and rest[0] in subcommands(parser):
        parser = subcommands(parser)[rest[0]]
        command.append(rest.pop(0))
    return " ".join(command), parser, " ".join(rest)


def test_docs_serve_md_is_what_the_parser_renders() -> None:
    assert DOC.read_text() == render(), "run `.venv/bin/python -m tools.gen_serve_docs` and commit docs/serve.md"


def test_every_serve_flag_is_in_docs_serve_md() -> None:
    doc = DOC.read_text()
    missing = [flag for flag in _options(serve_parser()) - {"-h", "--help"} if f"`{flag}" not in doc]
    assert not missing, missing


def test_the_docs_take_defaults_links_and_code_from_the_help_strings() -> None:
    parser = argparse.ArgumentParser(prog="x", description="See docs/lmtp.md#auth.")
    group = parser.add_argument_group("ports", "For --port.")
    group.add_argument("--port", type=int, default=1, metavar="PORT", help="where (docs/ui.md) (default: %(default)s)")
    group.add_argument("--no-x", dest="x", action="store_false", help="no x | y, see $HOME")
    text = render(parser)
    assert "See [docs/lmtp.md](lmtp.md#auth)." in text and "## ports\n\nFor `--port`.\n" in text
    assert "| `--port PORT` | 1 | where ([docs/ui.md](ui.md)) |" in text
    assert "| `--no-x` |  | no x \\| y, see `$HOME` |" in text


def test_the_readme_runs_salience_with_flags_it_has() -> None:
    wrong = [
        f"{command}: {flag}"
        for snippet in _code(README.read_text())
        if (found := _invocation(snippet))
        for command, parser, rest in [found]
        for flag in FLAG.findall(rest)
        if flag not in _options(parser)
    ]
    assert not wrong, wrong


def test_every_flag_the_readme_names_is_one_a_parser_has() -> None:
    known = _every_option(_parser()) | _tool_options() | OTHER_PROGRAMS
    unknown = sorted({flag for flag in FLAG.findall(README.read_text()) if flag[:2] == "--"} - known)
    assert not unknown, unknown
