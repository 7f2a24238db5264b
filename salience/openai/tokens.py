"""Each token's own text and bytes, as OpenAI's logprobs report them (`token`, `bytes`).

A token is not always a whole character: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) splits
an emoji over two tokens. OpenAI gives each token's exact UTF-8 bytes so a client can join them,
and a text that shows a partial character as U+FFFD. The bytes come from the token's vocabulary
string: byte-level vocabularies map every byte to one printable character (GPT-2's
bytes_to_unicode), SentencePiece writes a raw byte as `<0xE2>` and a space as `▁`. Decoding each
token alone (`tokenizer.decode([id])`) would lose both the partial bytes and, for SentencePiece,
the leading space.

Computed once per token id and kept: the same few thousand ids come back on every request, and
top_logprobs asks for up to 20 of them per token.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

__all__ = ["TokenText", "token_text"]

_RAW_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: each byte-level vocabulary character to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    codes = list(printable)
    for byte in range(256):
        if byte not in printable:
            codes.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(codes, chars, strict=True)}


def _byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's decoder is byte-level (its config names ByteLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


class TokenText:
    """A tokenizer's tokens as text and bytes, computed on first use."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoder = _byte_decoder() if _byte_level(tokenizer) else None
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._compute(token_id)
        return found

    def text(self, token_id: int) -> str:
        """The token's text; a partial character is U+FFFD (its bytes are exact)."""
        found = self._text.get(token_id)
        if found is None:
            found = self._text[token_id] = self.bytes(token_id).decode("utf-8", "replace")
        return found

    def _compute(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        decoder = self._decoder
        if decoder is not None and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        if raw := _RAW_BYTE.fullmatch(piece):
            return bytes([int(raw.group(1), 16)])
        return piece.replace("▁", " ").encode()


@functools.lru_cache(maxsize=4)
def token_text(tokenizer: Any) -> TokenText:
    """The one TokenText of a tokenizer, shared by every request on it."""
    return TokenText(tokenizer)
