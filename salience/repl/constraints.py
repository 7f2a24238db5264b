"""The REPL's structured-output commands: each sets the LMTP `structured_outputs` every later
GENERATE carries (docs/lmtp.md), checked at once by the reader the server uses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from salience.core.engine.constraints import parse_constraint
from salience.errors import InvalidArgument

__all__ = ["COMMANDS", "HELP", "constraint_field", "describe"]

COMMANDS = ("/json", "/regex", "/choice", "/grammar", "/free")
HELP = """\
  /json [SCHEMA|@FILE]       every later reply is JSON: valid under the schema (JSON text, or a
                             file holding it), or any JSON object without one
  /regex R                   every later reply matches the regular expression R (the rest of the line)
  /choice A|B|...            every later reply is one of the texts between the bars
  /grammar TEXT|@FILE        every later reply is a sentence of the grammar (EBNF/GBNF, or Lark)
  /free                      drop the constraint"""
_ARGUMENT = {"/regex": "R", "/choice": "A|B|...", "/grammar": "TEXT|@FILE"}


def constraint_field(command: str, arg: str) -> dict[str, Any] | None:
    """The `structured_outputs` a command sets (None: /free); ValueError names what is wrong."""
    if command == "/free":
        return None
    if command == "/json":
        field: dict[str, Any] = {"json": _text(arg)} if arg else {"json_object": True}
    elif not arg:
        raise ValueError(f"usage: {command} {_ARGUMENT[command]}")
    elif command == "/regex":
        field = {"regex": arg}
    elif command == "/choice":
        field = {"choice": arg.split("|")}
    else:
        field = {"grammar": _text(arg)}
    try:
        parse_constraint(field)
    except InvalidArgument as exc:
        raise ValueError(str(exc)) from None
    return field


def describe(field: dict[str, Any] | None, limit: int = 200) -> str:
    if field is None:
        return "no constraint"
    text = json.dumps(field)
    return f"structured_outputs {text if len(text) <= limit else text[: limit - 3] + '...'}"


def _text(arg: str) -> str:
    """The argument, or with `@FILE` that file's text."""
    if not arg.startswith("@"):
        return arg
    try:
        return Path(arg[1:]).expanduser().read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {arg[1:]}: {exc.strerror}") from None
