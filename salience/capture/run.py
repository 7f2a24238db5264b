"""One capture: documents in order, `batch` at a time, through a source into shards, with progress."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from salience.capture.corpus import corpus_digest, read_corpus
from salience.capture.shards import DTYPES, CapturedDocument, ShardWriter
from salience.capture.sources import Source
from salience.errors import InvalidArgument

__all__ = ["CaptureOptions", "capture"]


@dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    layers: tuple[int, ...]
    drop_first: bool = False  # leave each document's first position out (an attention sink)
    max_tokens_per_document: int | None = None  # None: as many as the context holds
    dtype: str = "float32"  # on disk: float32, float16 or bfloat16
    shard_tokens: int = 65536
    batch: int = 16


async def capture(corpus: Path, folder: Path, source: Source, model: str, options: CaptureOptions) -> ShardWriter:
    """Capture `corpus` into `folder`, resuming what an earlier run there left; returns the writer."""
    if options.dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    if not options.layers:
        raise InvalidArgument("name at least one layer to capture")
    settings = {
        "model": model,
        "layers": list(options.layers),
        "hidden_size": source.hidden_size,
        "dtype": options.dtype,
        "drop_first": options.drop_first,
        "max_tokens_per_document": options.max_tokens_per_document,
        "corpus": {"path": str(corpus), "sha256": corpus_digest(corpus)},
    }
    writer = ShardWriter.open(folder, settings, options.shard_tokens)
    limit = source.max_model_len - 1  # the engine decodes one step after a prompt
    if options.max_tokens_per_document is not None:
        limit = min(limit, options.max_tokens_per_document)
    start = 1 if options.drop_first else 0
    documents = itertools.islice(read_corpus(corpus), writer.documents_done, None)
    with tqdm(desc="capturing", unit="tok", unit_scale=True, initial=writer.tokens_done) as progress:
        progress.set_postfix(documents=writer.documents_done, shards=len(writer.shards))
        while chunk := list(itertools.islice(documents, options.batch)):
            ids = [source.tokenize(d.text)[:limit] for d in chunk]
            results = await source.rows(ids, options.layers, start)
            for document, tokens, (positions, rows) in zip(chunk, ids, results, strict=True):
                token_ids = np.asarray(tokens, np.int64)[positions] if len(positions) else np.zeros(0, np.int64)
                writer.add(CapturedDocument(document.index, document.id, token_ids, positions, rows))
                progress.update(len(positions))
            progress.set_postfix(documents=chunk[-1].index + 1, shards=len(writer.shards))
    writer.finish()
    return writer


def parse_layers(text: str) -> tuple[int, ...]:
    """ "12", "10,20" or "8-12"."""
    layers: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise InvalidArgument(f"layers must look like 12, 10,20 or 8-12, got {text!r}")
        layers.extend(range(int(first), int(last) + 1) if dash else [int(first)])
    return tuple(dict.fromkeys(layers))
