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

The scan resumes where it stopped (`Scanner`), so `Cursor` follows a reply as it is written: fed
each token's text, it names the leaves that text holds a character of, the value still being
written included, for monitors that watch one field (`pattern`: a JSONPath naming a leaf or a
container of leaves, `[*]` and `.*` for any index or key).

Sans I/O and free of the engine: the OpenAI frontend feeds it a choice's token texts, monitors
each generated token's.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Cursor", "Leaf", "Scanner", "Span", "leaves", "path", "pattern", "spans"]

_SPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*"')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = re.compile(r"[-+.0-9eE]+")
_LITERALS = ("true", "false", "null")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# One step of a JSONPath pattern: .name, .*, [3], [*], ['key'] or ["key"].
_STEP = re.compile(r"""\.([A-Za-z_][A-Za-z0-9_]*|\*)|\[(\d+|\*)\]|\['((?:[^'\\]|\\.)*)'\]|\[("(?:[^"\\]|\\.)*")\]""")
_ANY_KEY = r"(?:\.[A-Za-z_][A-Za-z0-9_]*|\['(?:[^'\\]|\\.)*'\])"


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
    return list(Scanner().scan(text))


class Scanner:
    """The scan of one JSON document, resumable as its text grows: each `scan` is given the whole
    text so far and yields the leaves completed since the last, stopping before a value that runs
    into the end (`open` then names it). `growing`: a number at the end may go on even outside any
    container (a whole text is done, a text still being written is not)."""

    def __init__(self, *, growing: bool = False) -> None:
        self._growing = growing
        self._steps: list[str | int] = []  # the current value's path
        self._stack: list[str] = []  # "{" or "[" per open container
        self._expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end | done
        self._pos = 0
        self.open: tuple[str, int] | None = None  # the path and start of a scalar cut by the end of the text

    def scan(self, text: str) -> Iterator[Leaf]:
        steps, stack = self._steps, self._stack
        self.open = None
        while self._expect != "done":
            pos = self._pos = _SPACE.match(text, self._pos).end()  # type: ignore[union-attr]
            if pos == len(text):
                return
            c, expect = text[pos], self._expect
            if expect in ("value", "value_or_end"):
                if expect == "value_or_end" and c == "]":
                    self._expect, self._pos = _close(stack, steps), pos + 1
                elif c in "{[":
                    stack.append(c)
                    if c == "[":
                        steps.append(0)
                    self._expect, self._pos = ("key_or_end" if c == "{" else "value_or_end"), pos + 1
                else:
                    quoted = c == '"'
                    end = _scalar(text, pos, open_document=bool(stack) or self._growing)
                    if end is None:
                        if _cut(text, pos):
                            self.open = (path(steps), pos + quoted)
                        return
                    yield Leaf(path(steps), pos + quoted, end - quoted)
                    self._expect, self._pos = ("comma_or_end" if stack else "done"), end
            elif expect in ("key", "key_or_end"):
                if expect == "key_or_end" and c == "}":
                    self._expect, self._pos = _close(stack, steps), pos + 1
                    continue
                match = _STRING.match(text, pos) if c == '"' else None
                if match is None:
                    return
                steps.append(json.loads(match.group()))
                self._expect, self._pos = "colon", match.end()
            elif expect == "colon":
                if c != ":":
                    return
                self._expect, self._pos = "value", pos + 1
            else:  # comma_or_end
                top = stack[-1]
                if c == ",":
                    if top == "[":
                        steps[-1] = steps[-1] + 1  # type: ignore[operator]
                        self._expect = "value"
                    else:
                        steps.pop()
                        self._expect = "key"
                    self._pos = pos + 1
                elif c == ("]" if top == "[" else "}"):
                    if top == "{":
                        steps.pop()
                    self._expect, self._pos = _close(stack, steps), pos + 1
                else:
                    return


def _close(stack: list[str], steps: list[str | int]) -> str:
    """Close the innermost container (an array's index leaves the path); what comes next."""
    if stack.pop() == "[":
        steps.pop()
    return "comma_or_end" if stack else "done"


def _cut(text: str, pos: int) -> bool:
    """Whether the scalar at `pos`, incomplete, runs into the end of the text (a string always
    does: only the end of the text leaves one unclosed in a valid document)."""
    rest = text[pos:]
    if rest[0] == '"':
        return True
    if rest[0] == "-" or rest[0].isdigit():
        return _NUMBER_CHARS.fullmatch(rest) is not None
    return any(literal.startswith(rest) for literal in _LITERALS)


def _scalar(text: str, pos: int, *, open_document: bool) -> int | None:
    """Where the scalar at `pos` ends, or None if there is none or it is incomplete."""
    c = text[pos]
    if c == '"':
        match = _STRING.match(text, pos)
        return match.end() if match else None
    if c == "-" or c.isdigit():
        match = _NUMBER.match(text, pos)
        # More of it may follow where its characters (`2.` of `2.5`) run to the end of the text.
        if match is None or (open_document and _NUMBER_CHARS.match(text, pos).end() == len(text)):  # type: ignore[union-attr]
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


@functools.lru_cache(maxsize=256)
def pattern(text: str) -> re.Pattern[str]:
    """The leaf paths at or under the JSONPath `text` (`$.city`, `$.items[2].name`, `$.items[*]`,
    `$['two words'].*`): a regular expression matching `path()`'s spelling. ValueError if it is
    not one."""
    if not text.startswith("$"):
        raise ValueError(f"a JSONPath starts with $, as in $.city or $.items[0].name, got {text!r}")
    out, pos = ["\\$"], 1
    while pos < len(text):
        step = _STEP.match(text, pos)
        if step is None:
            raise ValueError(f"{text!r} is not a JSONPath such as $.city, $.items[0].name or $.items[*] (at {pos})")
        name, index, single, double = step.groups()
        if name == "*":
            out.append(_ANY_KEY)
        elif index == "*":
            out.append(r"\[\d+\]")
        elif index is not None:
            out.append(re.escape(f"[{int(index)}]"))
        else:
            key = name if name is not None else json.loads(double) if double is not None else _unquote(single)
            out.append(re.escape(path((key,))[1:]))
        pos = step.end()
    return re.compile("".join(out) + r"(?=$|[.\[])")


def _unquote(single: str) -> str:
    return re.sub(r"\\(.)", r"\1", single)


class Cursor:
    """Where each new piece of a JSON text being written lies: the paths of the leaves it holds a
    character of, the value it ends inside included."""

    def __init__(self) -> None:
        self._scanner = Scanner(growing=True)
        self._text = ""

    def feed(self, piece: str) -> tuple[str, ...]:
        start = len(self._text)
        self._text += piece
        if not piece:
            return ()
        found = [leaf.path for leaf in self._scanner.scan(self._text) if leaf.end > max(leaf.start, start)]
        cut = self._scanner.open
        if cut is not None and cut[1] < len(self._text):
            found.append(cut[0])
        return tuple(found)
