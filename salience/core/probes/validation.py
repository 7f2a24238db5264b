"""How a concept's fits are judged: the folds its texts are held out in, the figures over their
held-out scores, and the layer those recommend.

Validation is stratified k-fold with a fixed seed (a pair stays in one fold; background texts
are dealt like a third class): every text is held out exactly once, scored by a direction and
calibrations fitted without it (probes/fitting.py), and the figures are computed over all
held-out scores. Per-text AUROC and accuracy (score > 0.5) are what `concept_info` publishes,
with 95% bootstrap intervals over the held-out texts; the background's **false-positive rate**
is the share of held-out background texts scoring above 0.5. Per-token figures (each token
labelled with its text's class) are published beside them as `token_*` and
`running_token_auroc`. The recommended layer is the one with the best held-out per-text AUROC
less the background false-positive rate (then per-token AUROC, then the earliest layer).

Only scores and labels come in: nothing here fits, so the figures read the same whatever
produced the scores.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "FEW_EXAMPLES",
    "LayerFit",
    "accuracy",
    "auroc",
    "best_layer",
    "bootstrap",
    "ece",
    "folds",
]

ECE_BINS = 10
FEW_EXAMPLES = 24  # per class: below it, held-out figures are too rough to read without their intervals
BOOTSTRAP_SAMPLES = 1000
INTERVAL = (0.025, 0.975)


@dataclass(frozen=True, kw_only=True)
class LayerFit:
    """One layer's held-out figures (k-fold) and, after the refit on every text, its calibrations."""

    layer: int
    scale: float  # the token view's calibration
    offset: float
    running_scale: float  # the running view's
    running_offset: float
    auroc: float  # per text (its running p at the last token), held out
    auroc_interval: tuple[float, float]
    accuracy: float
    accuracy_interval: tuple[float, float]
    token_auroc: float  # per token, token view, held out
    token_accuracy: float
    running_token_auroc: float  # per token, running view
    token_mean_auroc: float  # per text, scored by the mean token-view p instead
    brier: float  # per token, token view, held out
    ece: float
    background_fpr: float | None = None  # held-out background texts scoring above 0.5
    background_fpr_interval: tuple[float, float] | None = None
    background_texts: int = 0

    def as_dict(self) -> dict:
        return {
            name: list(value) if isinstance(value, tuple) else value
            for name in self.__dataclass_fields__
            if (value := getattr(self, name)) is not None
        }


def folds(
    labels: torch.Tensor,
    k: int,
    seed: int,
    *,
    pairs: torch.Tensor | None = None,
    background: torch.Tensor | None = None,
) -> torch.Tensor:
    """[texts] fold index: each class shuffled with `seed` and dealt round-robin, so every fold
    holds both classes in proportion. `pairs` ([texts] int, -1 for a text in no pair) keeps a
    matched pair in one fold; `background` texts are dealt as a class of their own."""
    generator = torch.Generator().manual_seed(seed)
    fold = torch.empty(len(labels), dtype=torch.long)
    pairs = torch.full_like(labels, -1, dtype=torch.long) if pairs is None else pairs
    background = torch.zeros_like(labels) if background is None else background
    ids = torch.unique(pairs[pairs >= 0])
    ids = ids[torch.randperm(len(ids), generator=generator)]
    for i, pair in enumerate(ids.tolist()):
        fold[pairs == pair] = i % k
    single = (pairs < 0) & ~background
    for members, start in (
        (single & labels, len(ids)),
        (single & ~labels, len(ids)),
        (background, 0),
    ):
        members = torch.nonzero(members).squeeze(1)
        members = members[torch.randperm(len(members), generator=generator)]
        fold[members] = (torch.arange(len(members)) + start) % k
    return fold


def best_layer(fits: Sequence[LayerFit]) -> LayerFit:
    return max(fits, key=lambda fit: (fit.auroc - (fit.background_fpr or 0.0), fit.token_auroc, -fit.layer))


def bootstrap(
    score: torch.Tensor, labels: torch.Tensor, background: torch.Tensor, samples: int = BOOTSTRAP_SAMPLES
) -> dict[str, tuple[float, float]]:
    """95% percentile intervals of the per-text figures, resampling texts with replacement within
    each class (positives, negatives, background) with a fixed seed."""
    own = ~background
    groups = [own & labels, own & ~labels] + ([background] if background.any() else [])
    up, down, *rest = _resamples(tuple(int(members.sum()) for members in groups), samples)
    positive, negative = score[own & labels], score[own & ~labels]
    wins = (positive[:, None] > negative[None, :]).double() + 0.5 * (positive[:, None] == negative[None, :]).double()
    figures = {
        "auroc": ((up @ wins) * down).sum(1) / (len(positive) * len(negative)),
        "accuracy": (up @ (positive > 0.5).double() + down @ (negative <= 0.5).double())
        / (len(positive) + len(negative)),
    }
    if rest:
        figures["background_fpr"] = rest[0] @ (score[background] > 0.5).double() / int(background.sum())
    bounds = torch.tensor(INTERVAL, dtype=torch.float64)
    return {name: tuple(torch.quantile(values, bounds).tolist()) for name, values in figures.items()}  # type: ignore[misc]


@functools.lru_cache(maxsize=4)
def _resamples(sizes: tuple[int, ...], samples: int) -> tuple[torch.Tensor, ...]:
    """Per group of `sizes` members, [samples, size]: how often each member is drawn in each
    resample, drawn in group order from seed 0. The same for every layer and method of a concept:
    drawn once (read only)."""
    generator = torch.Generator().manual_seed(0)
    drawn = [torch.randint(0, n, (samples, n), generator=generator) for n in sizes]
    return tuple(
        torch.zeros(samples, n, dtype=torch.float64).scatter_add_(1, d, torch.ones_like(d).double())
        for n, d in zip(sizes, drawn, strict=True)
    )


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(a positive scores above a negative), ties counting half (Mann-Whitney U)."""
    positive, negative = scores[labels], scores[~labels]
    if not len(positive) or not len(negative):
        return math.nan
    ordered, order = torch.sort(scores)
    _, run, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    last = torch.cumsum(counts, 0).to(scores.dtype)  # each run of equal scores' last 1-based rank
    ranks = torch.empty_like(scores)
    ranks[order] = (last - (counts - 1).to(scores.dtype) / 2)[run]  # ties share their mean rank
    u = float(ranks[labels].sum()) - len(positive) * (len(positive) + 1) / 2
    return u / (len(positive) * len(negative))


def accuracy(p: torch.Tensor, labels: torch.Tensor) -> float:
    return float(((p > 0.5) == labels).double().mean())


def ece(p: torch.Tensor, labels: torch.Tensor) -> float:
    """Expected calibration error: |mean p - positive rate| over ten equal-width bins, by bin size."""
    bins = torch.clamp((p * ECE_BINS).long(), max=ECE_BINS - 1)
    total = 0.0
    for b in torch.unique(bins):
        inside = bins == b
        total += float(inside.sum()) * abs(float(p[inside].mean()) - float(labels[inside].double().mean()))
    return total / len(p)
