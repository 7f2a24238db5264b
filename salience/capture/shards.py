"""Activation shards: safetensors files of residual rows, an index per shard, and a manifest that
makes an interrupted capture resumable.

A capture folder holds:

    manifest.json          what was captured (model, layers, dtype, options, corpus digest) and the
                           shards written so far, each with the documents and tokens it holds
    shard-00000.safetensors  `layer.<L>` [tokens, hidden] per layer (the chosen dtype), `token_ids`
                           [tokens] int64, `positions` [tokens] int64, `documents` [tokens] int64
    shard-00000.jsonl      one line per document: {"document", "id", "start", "tokens"}: its rows
                           are start .. start + tokens of the shard

A shard closes at the first document boundary at or past `shard_tokens` rows, and is written
atomically (a temporary file, then a rename) before the manifest names it. Resuming skips the
documents of the shards the manifest names and starts a new shard at the next one, so an
interrupted and resumed capture writes the same shards as one that never stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from salience.errors import InvalidArgument

__all__ = ["DTYPES", "CapturedDocument", "ShardWriter"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class CapturedDocument:
    index: int
    id: str
    token_ids: np.ndarray  # [n] the captured positions' tokens
    positions: np.ndarray  # [n]
    rows: np.ndarray  # [n, layers, hidden] float32


@dataclass
class ShardWriter:
    folder: Path
    settings: dict  # model, layers, hidden_size, dtype, options, corpus digest: must match to resume
    shard_tokens: int
    shards: list[dict] = field(default_factory=list)
    _pending: list[CapturedDocument] = field(default_factory=list)

    @classmethod
    def open(cls, folder: Path, settings: dict, shard_tokens: int) -> ShardWriter:
        """A new capture, or the one in `folder` resumed (refused if it was made differently)."""
        folder.mkdir(parents=True, exist_ok=True)
        manifest = folder / MANIFEST
        if not manifest.exists():
            writer = cls(folder, settings, shard_tokens)
            writer._save_manifest(done=False)
            return writer
        saved = json.loads(manifest.read_text())
        wanted = {**settings, "shard_tokens": shard_tokens}
        differs = sorted(k for k in wanted if saved.get(k) != wanted[k])
        if differs:
            raise InvalidArgument(
                f"{folder} holds a capture made with other {', '.join(differs)}: "
                "resume with the same options, or write to another folder"
            )
        return cls(folder, settings, shard_tokens, list(saved["shards"]))

    @property
    def documents_done(self) -> int:
        return sum(shard["documents"] for shard in self.shards)

    @property
    def tokens_done(self) -> int:
        return sum(shard["tokens"] for shard in self.shards)

    def add(self, document: CapturedDocument) -> None:
        self._pending.append(document)
        if sum(len(d.token_ids) for d in self._pending) >= self.shard_tokens:
            self._flush()

    def finish(self) -> None:
        if self._pending:
            self._flush()
        self._save_manifest(done=True)

    def _flush(self) -> None:
        number = len(self.shards)
        name = f"shard-{number:05d}"
        dtype = DTYPES[self.settings["dtype"]]
        rows = np.concatenate([d.rows for d in self._pending])
        tensors = {
            f"layer.{layer}": torch.from_numpy(np.ascontiguousarray(rows[:, i])).to(dtype)
            for i, layer in enumerate(self.settings["layers"])
        }
        tensors["token_ids"] = torch.from_numpy(np.concatenate([d.token_ids for d in self._pending]).astype(np.int64))
        tensors["positions"] = torch.from_numpy(np.concatenate([d.positions for d in self._pending]).astype(np.int64))
        tensors["documents"] = torch.from_numpy(
            np.concatenate([np.full(len(d.token_ids), d.index, dtype=np.int64) for d in self._pending])
        )
        from safetensors.torch import save_file

        _atomic(self.folder / f"{name}.safetensors", lambda path: save_file(tensors, str(path)))
        lines, start = [], 0
        for d in self._pending:
            lines.append(json.dumps({"document": d.index, "id": d.id, "start": start, "tokens": len(d.token_ids)}))
            start += len(d.token_ids)
        _atomic(self.folder / f"{name}.jsonl", lambda path: path.write_text("\n".join(lines) + "\n"))
        self.shards.append(
            {"file": f"{name}.safetensors", "index": f"{name}.jsonl", "documents": len(self._pending), "tokens": start}
        )
        self._pending = []
        self._save_manifest(done=False)

    def _save_manifest(self, done: bool) -> None:
        manifest = {**self.settings, "shard_tokens": self.shard_tokens, "shards": self.shards, "done": done}
        _atomic(self.folder / MANIFEST, lambda path: path.write_text(json.dumps(manifest, indent=1) + "\n"))


def _atomic(path: Path, write) -> None:
    temporary = path.with_name(path.name + ".partial")
    write(temporary)
    os.replace(temporary, path)
