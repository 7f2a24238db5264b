"""Rebuild the seed's proto from its text, independently of the project's copy.

The seed (../shared/seeds/000_*.txt) is the proto with every line break turned into a space, so
each `//` comment runs into the statement after it. A comment is ended at the first thing that
can only be proto syntax: a field, enum value, rpc, block opening or closing brace.
"""

from __future__ import annotations

import re
from pathlib import Path

# A verbatim copy of ../shared/seeds/000_*.txt, so a clean checkout has it.
SEED = Path(__file__).with_name("seed_000_salience_proto.txt")

_STATEMENT = re.compile(
    r"""(?x)
      syntax\s*=\s*"proto3"\s*;
    | package\s+[\w.]+\s*;
    | (?:service|message|enum|oneof)\s+\w+\s*\{
    | rpc\s+\w+\s*\(.*?\)\s*returns\s*\(.*?\)\s*;
    | (?:repeated\s+)?[\w.]+\s+[a-z_][a-z0-9_]*\s*=\s*\d+\s*(?:\[[^\]]*\])?\s*;
    | [A-Z][A-Z0-9_]*\s*=\s*\d+\s*;
    | \}
    """
)


def seed_text() -> str:
    return SEED.read_text()


def reflow(text: str) -> str:
    """Return the seed as a compilable proto: one statement or comment per line."""
    lines: list[str] = []
    rest = text.strip()
    while rest:
        if rest.startswith("//"):
            match = _STATEMENT.search(rest, 2)
            end = match.start() if match else len(rest)
            lines.append(rest[:end].rstrip())
        else:
            match = _STATEMENT.match(rest)
            if match is None:
                raise ValueError(f"cannot read the seed at: {rest[:80]!r}")
            end = match.end()
            lines.append(rest[:end])
        rest = rest[end:].lstrip()
    return "\n".join(lines) + "\n"
