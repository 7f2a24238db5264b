"""Where each JSON leaf of a generated text lies, in characters and in tokens: readouts per field.

Theory of operation. A structured-output reply is a JSON document written token by token.
`leaves` scans its text once, after the fact, with an explicit stack (no recursion, so nesting
depth is bounded by nothing but the text), and yields each scalar value (string, number, `true`,
`false`, `null`) with its JSONPath (`$.city`, `$.items[2].name`; a key that is not an identifier
is bracketed, `$['two words']`) and its characters, a string's quotes excluded. Empty objects and
arrays hold no value, so they are not leaves. The scan stops at the first character that is not
JSON or where the text ends: a reply cut short (`max_tokens`) keeps the leaves it completed, and a
number running into the end of an unfinished document is not complete, so it is left out.

`spans` maps leaves to tokens given each token's text (what the detokenizer released for it, so
a character split over two tokens belongs to the one that completes it): a leaf's tokens are
those whose text holds a character of the value, so a token that straddles a key and a value
(`":"P`) is the value's first. An empty string holds no character, hence no token.

Sans I/O and free of the engine: the OpenAI frontend feeds it a choice's token texts.
"""

from __future__ import annotations

import bisect
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Leaf", "Span", "leaves", "path", "spans"]

_SPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class Leaf:
    """A scalar value: its JSONPath and its characters `[start, end)` in the text."""

    path: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class Span:
    """A leaf and its tokens, `first` to `last` inclusive (None for an empty string)."""

    leaf: Leaf
    first: int | None
    last: int | None


def path(steps: Sequence[str | int]) -> str:
    """JSONPath of a value reached by `steps` (object keys and array indexes) from the root."""
    out = ["$"]
    for step in steps:
        if isinstance(step, int):
            out.append(f"[{step}]")
        elif _NAME.fullmatch(step):
            out.append(f".{step}")
        else:
            out.append("['" + step.replace("\\", "\\\\").replace("'", "\\'") + "']")
    return "".join(out)


def leaves(text: str) -> list[Leaf]:
    """Every complete scalar value of the JSON document at the start of `text`, in text order."""
    return list(_scan(text))


def _scan(text: str) -> Iterator[Leaf]:
    steps: list[str | int] = []  # the current value's path
    stack: list[str] = []  # "{" or "[" per open container
    expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end | done
    pos = 0
    while expect != "done":
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos == len(text):
            return
        c = text[pos]
        if expect in ("value", "value_or_end"):
            if expect == "value_or_end" and c == "]":
                expect, pos = _close(stack, steps), pos + 1
            elif c in "{[":
                stack.append(c)
                if c == "[":
                    steps.append(0)
                expect, pos = ("key_or_end" if c == "{" else "value_or_end"), pos + 1
            else:
                end = _scalar(text, pos, open_document=bool(stack))
                if end is None:
                    return
                quoted = c == '"'
                yield Leaf(path(steps), pos + quoted, end - quoted)
                if not stack:
                    return
                expect, pos = "comma_or_end", end
        elif expect in ("key", "key_or_end"):
            if expect == "key_or_end" and c == "}":
                expect, pos = _close(stack, steps), pos + 1
                continue
            match = _STRING.match(text, pos) if c == '"' else None
            if match is None:
                return
            steps.append(json.loads(match.group()))
            expect, pos = "colon", match.end()
        elif expect == "colon":
            if c != ":":
                return
            expect, pos = "value", pos + 1
        else:  # comma_or_end
            top = stack[-1]
            if c == ",":
                if top == "[":
                    steps[-1] = steps[-1] + 1  # type: ignore[operator]
                    expect = "value"
                else:
                    steps.pop()
                    expect = "key"
                pos += 1
            elif c == ("]" if top == "[" else "}"):
                if top == "{":
                    steps.pop()
                expect, pos = _close(stack, steps), pos + 1
            else:
                return


def _close(stack: list[str], steps: list[str | int]) -> str:
    """Close the innermost container (an array's index leaves the path); what comes next."""
    if stack.pop() == "[":
        steps.pop()
    return "comma_or_end" if stack else "done"


def _scalar(text: str, pos: int, *, open_document: bool) -> int | None:
    """Where the scalar at `pos` ends, or None if there is none or it is incomplete."""
    c = text[pos]
    if c == '"':
        match = _STRING.match(text, pos)
        return match.end() if match else None
    if c == "-" or c.isdigit():
        match = _NUMBER.match(text, pos)
        if match is None or (open_document and match.end() == len(text)):  # more digits may follow
            return None
        return match.end()
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return pos + len(literal)
    return None


def spans(found: Sequence[Leaf], texts: Sequence[str]) -> list[Span]:
    """Each leaf's first and last token, the tokens' `texts` joined being the text scanned."""
    starts, offset = [], 0
    for piece in texts:
        starts.append(offset)
        offset += len(piece)
    out = []
    for leaf in found:
        if leaf.start == leaf.end:
            out.append(Span(leaf, None, None))
            continue
        # The token holding a character is the last one starting at or before it: a token with
        # no text starts where the next one does, so it never holds one.
        first = bisect.bisect_right(starts, leaf.start) - 1
        last = bisect.bisect_right(starts, leaf.end - 1) - 1
        out.append(Span(leaf, first, last))
    return out
