"""A text as the model reads it: its ids after the special tokens its tokenizer puts first.

Concepts are fitted, live concepts defined and texts captured on the ids a client's prompt
gets from the same tokenizer. A model trained with BOS first reads a text without it in a
state it never saw (Gemma-3-270M: perplexity ~380 on plain English without BOS, ~13 with), so
directions fitted there would not read served prompts. Tokens a tokenizer appends (an EOS) are
left off: a text is read as a prompt, not as a finished document. For a tokenizer that adds
nothing, the default model's, these are the text's plain ids.
"""

from __future__ import annotations

from typing import Any

__all__ = ["text_ids"]


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids as the model reads it (a Hugging Face tokenizer's leading special tokens kept)."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.encode(text)
    lead = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    return full[:lead] + plain
