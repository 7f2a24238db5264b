"""Where one SAE feature fires most in a capture: the top activations with their context, and how
often it fires at all, in one streaming pass over the shards.

Memory stays bounded whatever the capture's size: rows are read from each shard's safetensors a
chunk at a time (never a whole layer), encoded under no_grad, and only a running top-`count` is
kept. Documents never span shards (a shard closes at a document boundary), so a hit's context is
taken from its own shard, and it never crosses into another document.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.core.features.sae import SparseAutoencoder

__all__ = ["FeatureHit", "FeatureReport", "feature_report", "top_activations"]

MANIFEST = "manifest.json"
_CHUNK_ELEMENTS = 2**24  # activations per encoded chunk (64 MiB of float32), so wide SAEs take fewer rows


@dataclass(frozen=True)
class FeatureHit:
    activation: float
    document: int  # the corpus index
    document_id: str
    position: int  # in the document's tokens (what was captured: with --drop-first there is no 0)
    token_id: int
    before: tuple[int, ...]  # up to `context` captured tokens before it, of the same document
    after: tuple[int, ...]  # up to `after` captured tokens after it, of the same document


@dataclass(frozen=True)
class FeatureReport:
    feature: int
    layer: int
    hits: tuple[FeatureHit, ...]  # activation descending, ties in corpus order; only tokens it fired on
    context: int  # the most tokens each hit's `before` holds
    after: int  # the most its `after` holds
    tokens_seen: int
    fired: int  # tokens with activation > 0
    max_activation: float  # 0.0 when it never fired
    documents_seen: int
    shards_read: int
    complete: bool  # False: the capture was unfinished (or is still running); this is what it held

    @property
    def density(self) -> float:
        return self.fired / self.tokens_seen if self.tokens_seen else 0.0


def top_activations(
    capture_folder: Path, sae: SparseAutoencoder, feature: int, *, count: int = 20, context: int = 8
) -> list[FeatureHit]:
    """The `count` tokens where `feature` fires most: `feature_report`'s hits."""
    return list(feature_report(capture_folder, sae, feature, count=count, context=context).hits)


def feature_report(
    capture_folder: Path,
    sae: SparseAutoencoder,
    feature: int,
    *,
    count: int = 20,
    context: int = 8,
    after: int | None = None,
    chunk_rows: int | None = None,
) -> FeatureReport:
    """One pass over the capture: its top `count` hits (with `context` tokens before and `after`,
    default half as many, after) and how often and how strongly the feature fires."""
    manifest = _check(capture_folder, sae, feature, count, context)
    after = (context + 1) // 2 if after is None else after
    encode = _one_feature(sae, feature)
    width = sae.d_sae if sae.architecture == "topk" else 1
    chunk_rows = chunk_rows or max(1, min(8192, _CHUNK_ELEMENTS // width))
    key = f"layer.{sae.layer}"
    best: list[tuple[float, int, FeatureHit]] = []  # (activation, row in the whole capture, hit)
    seen = fired = documents = 0
    peak = 0.0
    from safetensors import safe_open

    for shard in manifest["shards"]:
        index = [json.loads(line) for line in (capture_folder / shard["index"]).read_text().splitlines() if line]
        with safe_open(str(capture_folder / shard["file"]), framework="pt") as tensors:
            token_ids = tensors.get_tensor("token_ids").numpy()
            positions = tensors.get_tensor("positions").numpy()
            layer = tensors.get_slice(key)
            rows = len(token_ids)
            starts = np.array([d["start"] for d in index], np.int64)
            for begin in range(0, rows, chunk_rows):
                end = min(rows, begin + chunk_rows)
                with torch.no_grad():
                    acts = encode(layer[begin:end].to(torch.float32)).to(torch.float32).numpy()
                fired += int((acts > 0).sum())
                peak = max(peak, float(acts.max(initial=0.0)))
                # A row ties with the last kept one only to lose: it comes later in the corpus.
                candidates = np.flatnonzero(acts > (best[-1][0] if len(best) == count else 0.0))
                if len(candidates) > count:  # keep ties at the cut: they may win on corpus order
                    cut = np.partition(acts[candidates], -count)[-count]
                    candidates = candidates[acts[candidates] >= cut]
                for row in candidates + begin:
                    document = index[int(np.searchsorted(starts, row, side="right")) - 1]
                    first, stop = document["start"], document["start"] + document["tokens"]
                    hit = FeatureHit(
                        activation=float(acts[row - begin]),
                        document=int(document["document"]),
                        document_id=str(document["id"]),
                        position=int(positions[row]),
                        token_id=int(token_ids[row]),
                        before=tuple(int(t) for t in token_ids[max(first, row - context) : row]),
                        after=tuple(int(t) for t in token_ids[row + 1 : min(stop, row + 1 + after)]),
                    )
                    best.append((hit.activation, seen + int(row), hit))
                best = sorted(best, key=lambda entry: (-entry[0], entry[1]))[:count]
        seen += rows
        documents += shard["documents"]
    return FeatureReport(
        feature=feature,
        layer=sae.layer,
        hits=tuple(hit for _, _, hit in best),
        context=context,
        after=after,
        tokens_seen=seen,
        fired=fired,
        max_activation=peak,
        documents_seen=documents,
        shards_read=len(manifest["shards"]),
        complete=bool(manifest.get("done")),
    )


def _one_feature(sae: SparseAutoencoder, feature: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """rows [n, d_in] -> the feature's activations [n]. A standard or jumprelu feature depends on its
    own encoder column alone, so only that column is multiplied (d_sae times less work: the SAE cut
    down to one feature, its own encode doing the math); a topk one on whether it is among the k
    largest of all, so every feature is encoded."""
    if sae.architecture == "topk":
        return lambda rows: sae.encode(rows)[:, feature]
    one = slice(feature, feature + 1)
    threshold = None if sae.threshold is None else sae.threshold[one]
    single = dataclasses.replace(sae, W_enc=sae.W_enc[:, one], b_enc=sae.b_enc[one], threshold=threshold, d_sae=1)
    return lambda rows: single.encode(rows)[:, 0]


def _check(folder: Path, sae: SparseAutoencoder, feature: int, count: int, context: int) -> dict:
    """The capture's manifest, once everything that would make the pass meaningless is refused."""
    if count < 1:
        raise InvalidArgument(f"count must be 1 or more, got {count}")
    if context < 0:
        raise InvalidArgument(f"context must be 0 or more, got {context}")
    if not 0 <= feature < sae.d_sae:
        raise InvalidArgument(f"feature {feature} is out of range: the SAE has features 0 to {sae.d_sae - 1}")
    path = folder / MANIFEST
    if not path.is_file():
        raise InvalidArgument(f"{folder} is not a capture folder (no {MANIFEST}): write one with salience capture")
    manifest = json.loads(path.read_text())
    layers = manifest.get("layers", [])
    if sae.point != "resid_post":  # a capture holds residual rows, the layers' outputs
        raise InvalidArgument(f"the SAE reads {sae.hook_name}, but a capture holds the residual after each layer")
    if sae.layer not in layers:
        held = ", ".join(str(layer) for layer in layers) or "none"
        raise InvalidArgument(f"the SAE reads layer {sae.layer}, but the capture in {folder} holds layers {held}")
    if manifest.get("hidden_size") != sae.d_in:
        raise InvalidArgument(
            f"the SAE reads {sae.d_in}-wide rows, but the capture in {folder} holds "
            f"{manifest.get('hidden_size')}-wide ones: another model"
        )
    return manifest
