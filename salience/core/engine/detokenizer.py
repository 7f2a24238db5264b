"""Incremental detokenization that never splits a character.

A multi-byte character can span tokens; decoding token by token would emit
U+FFFD halves. We decode a short window ending at the newest token and emit
only the text that is complete, the way vLLM's own detokenizer does; whatever
is still incomplete when the stream ends is flushed as it decodes. With `skip_special_tokens`
special tokens add no text (vLLM's server's default; LMTP keeps them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["TextStream"]

_REPLACEMENT = "\ufffd"


class TextStream:
    """Feed token ids one at a time; get back the text each one completes."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = (), *, skip_special_tokens: bool = False) -> None:
        # A few context tokens let tokenizers that drop a leading space
        # (SentencePiece) decode the first new token correctly.
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._tokens = list(context[-4:])
        self._prefix = 0
        self._read = len(self._tokens)

    def _decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=self._skip)

    def push(self, token: int) -> str:
        self._tokens.append(token)
        done = self._decode(self._tokens[self._prefix : self._read])
        text = self._decode(self._tokens[self._prefix :])
        if len(text) > len(done) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._tokens)
            return text[len(done) :]
        return ""

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character at the end)."""
        done = self._decode(self._tokens[self._prefix : self._read])
        text = self._decode(self._tokens[self._prefix :])
        self._prefix = self._read = len(self._tokens)
        return text[len(done) :]
