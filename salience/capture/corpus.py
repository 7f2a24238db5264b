"""Documents from a corpus file: one text per line, or JSONL with a `text` (and optional `id`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from salience.errors import InvalidArgument

__all__ = ["Document", "corpus_digest", "read_corpus"]


@dataclass(frozen=True)
class Document:
    index: int  # its place in the corpus, from 0: what resuming counts
    id: str
    text: str


def read_corpus(path: Path) -> Iterator[Document]:
    """Every non-empty document, in file order. A `.jsonl` file holds {"text": ..., "id"?: ...}
    objects; any other file one text per line."""
    jsonl = path.suffix == ".jsonl"
    index = 0
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument(f"cannot read corpus {path}: {exc}") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            if jsonl:
                try:
                    record = json.loads(line)
                    text, doc_id = record["text"], str(record.get("id", number))
                except (ValueError, KeyError, TypeError):
                    raise InvalidArgument(f'{path}:{number}: a JSONL document is {{"text": ..., "id"?: ...}}') from None
                if not isinstance(text, str):
                    raise InvalidArgument(f"{path}:{number}: text must be a string")
            else:
                text, doc_id = line.rstrip("\n"), str(number)
            yield Document(index, doc_id, text)
            index += 1


def corpus_digest(path: Path) -> str:
    """sha256 of the corpus file: a resumed capture must read the same documents."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
