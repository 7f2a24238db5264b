"""Concept directions and their calibration, fitted from labelled texts and validated on held-out ones.

Theory of operation. A concept is given as positive and negative example texts. Each text
contributes its residuals at every read layer, one row per token after the first (the first
token's residual is an attention sink, orders of magnitude larger than the rest, and says
nothing about the text). At one layer:

- A **direction** d (unit length) is fitted from the fit texts, by one of two methods:
  `diff_means`, the difference of the class means of per-text mean residuals; or `logreg`, an
  L2-regularised logistic regression on the per-text mean residuals, standardised per
  dimension, mapped back to the residual's own coordinates. The readout is <h, d>.
- A **calibration** maps a token's readout r to a probability, p = 1 / (1 + exp(-(scale * r +
  offset))): a logistic regression of the token's label (its text's class) on r, each text
  weighing the same whatever its length, each class half. 0.5 is then the decision boundary.
- A **text's score** is the mean p over its tokens. Per-text AUROC and accuracy (score > 0.5)
  are what `concept_info` publishes; per-token figures (each token labelled with its text's
  class) are published beside them as `token_*`.

Validation is stratified k-fold with a fixed seed: every text is held out exactly once, scored
by a direction and calibration fitted without it, and the figures are computed over all
held-out scores. The directions and calibrations that are stored are then refitted on every
text. The recommended layer is the one with the best held-out per-text AUROC (then per-token
AUROC, then the earliest layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "METHODS",
    "Calibration",
    "LayerFit",
    "Residuals",
    "auroc",
    "best_layer",
    "calibrate",
    "cross_validate",
    "fit_direction",
    "folds",
    "logit_lens",
]

METHODS = ("diff_means", "logreg")
LOGREG_L2 = 1e-2  # on standardised per-text means: enough for a few dozen texts in hundreds of dimensions
CALIBRATION_L2 = 1e-3  # on the standardised readout: keeps the scale finite when the classes separate
ECE_BINS = 10


@dataclass(frozen=True)
class Residuals:
    """One concept's texts at one layer: every token row, which text it belongs to, each text's class."""

    rows: torch.Tensor  # [tokens, hidden] float64
    text: torch.Tensor  # [tokens] int64: the index of the row's text
    labels: torch.Tensor  # [texts] bool: positive or not

    @property
    def texts(self) -> int:
        return len(self.labels)

    def means(self) -> torch.Tensor:
        """[texts, hidden]: each text's mean residual."""
        sums = torch.zeros(self.texts, self.rows.shape[1], dtype=self.rows.dtype).index_add_(0, self.text, self.rows)
        return sums / torch.bincount(self.text, minlength=self.texts).clamp(min=1).unsqueeze(1).to(self.rows.dtype)

    def subset(self, keep: torch.Tensor) -> Residuals:
        """The texts `keep` (a [texts] bool mask) names, renumbered in order."""
        renumber = torch.cumsum(keep.long(), 0) - 1
        rows = keep[self.text]
        return Residuals(self.rows[rows], renumber[self.text[rows]], self.labels[keep])


@dataclass(frozen=True)
class Calibration:
    scale: float
    offset: float

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.scale * raw + self.offset)


@dataclass(frozen=True, kw_only=True)
class LayerFit:
    """One layer's held-out figures (k-fold) and, after the refit on every text, its calibration."""

    layer: int
    scale: float
    offset: float
    auroc: float  # per text, held out
    accuracy: float
    token_auroc: float  # per token, held out
    token_accuracy: float
    brier: float  # per token, held out
    ece: float

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def fit_direction(method: str, data: Residuals, l2: float = LOGREG_L2) -> torch.Tensor:
    """The unit direction [hidden] that separates the classes, positive side up."""
    means = data.means()
    positive, negative = means[data.labels], means[~data.labels]
    if method == "diff_means":
        direction = positive.mean(0) - negative.mean(0)
    elif method == "logreg":
        center, spread = means.mean(0), means.std(0).clamp(min=1e-6)
        weights = _logistic((means - center) / spread, data.labels.double(), _balanced(data.labels), l2)
        direction = weights[:-1] / spread
    else:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    return direction / direction.norm()


def calibrate(raw: torch.Tensor, data: Residuals) -> Calibration:
    """The logistic map from a token's readout to its text's class, every text weighing the same."""
    per_text = _balanced(data.labels)
    weights = per_text[data.text] / torch.bincount(data.text, minlength=data.texts)[data.text]
    # Standardise so one Newton solve suits readouts of any magnitude, then undo it.
    center, spread = raw.mean(), raw.std().clamp(min=1e-12)
    labels = data.labels[data.text].double()
    scale, offset = _logistic(((raw - center) / spread).unsqueeze(1), labels, weights, CALIBRATION_L2)
    return Calibration(scale=float(scale / spread), offset=float(offset - scale * center / spread))


def folds(labels: torch.Tensor, k: int, seed: int) -> torch.Tensor:
    """[texts] fold index: each class shuffled with `seed` and dealt round-robin, so every fold
    holds both classes in proportion."""
    generator = torch.Generator().manual_seed(seed)
    fold = torch.empty(len(labels), dtype=torch.long)
    for side in (True, False):
        members = torch.nonzero(labels == side).squeeze(1)
        members = members[torch.randperm(len(members), generator=generator)]
        fold[members] = torch.arange(len(members)) % k
    return fold


def cross_validate(method: str, layer: int, data: Residuals, fold: torch.Tensor) -> LayerFit:
    """Held-out figures over every fold, and the calibration of the direction refitted on every text."""
    token_p = torch.empty(len(data.rows), dtype=torch.float64)
    for f in range(int(fold.max()) + 1):
        held = fold == f
        fit = data.subset(~held)
        direction = fit_direction(method, fit)
        calibration = calibrate(fit.rows @ direction, fit)
        token_p[held[data.text]] = calibration(data.rows[held[data.text]] @ direction)
    text_p = torch.zeros(data.texts, dtype=torch.float64).index_add_(0, data.text, token_p)
    text_p /= torch.bincount(data.text, minlength=data.texts)
    token_labels = data.labels[data.text]
    final = calibrate(data.rows @ fit_direction(method, data), data)
    return LayerFit(
        layer=layer,
        scale=final.scale,
        offset=final.offset,
        auroc=auroc(text_p, data.labels),
        accuracy=_accuracy(text_p, data.labels),
        token_auroc=auroc(token_p, token_labels),
        token_accuracy=_accuracy(token_p, token_labels),
        brier=float(((token_p - token_labels.double()) ** 2).mean()),
        ece=_ece(token_p, token_labels),
    )


def best_layer(fits: Sequence[LayerFit]) -> LayerFit:
    return max(fits, key=lambda fit: (fit.auroc, fit.token_auroc, -fit.layer))


def logit_lens(direction: torch.Tensor, norm: torch.Tensor, unembedding: torch.Tensor, k: int = 10):
    """The token ids a direction raises most and lowers most (k each, strongest first): the vector
    through the final RMS norm's weight and the unembedding. The norm's scaling by 1/rms is one
    positive factor for the whole vector, so it changes no ranking and is left out."""
    logits = unembedding.double() @ (norm.double() * direction.double())
    return torch.topk(logits, k).indices.tolist(), torch.topk(-logits, k).indices.tolist()


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(a positive scores above a negative), ties counting half (Mann-Whitney U)."""
    positive, negative = scores[labels], scores[~labels]
    if not len(positive) or not len(negative):
        return math.nan
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores)
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=scores.dtype)
    for value in torch.unique(scores):  # ties share their mean rank
        tied = scores == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    u = float(ranks[labels].sum()) - len(positive) * (len(positive) + 1) / 2
    return u / (len(positive) * len(negative))


def _accuracy(p: torch.Tensor, labels: torch.Tensor) -> float:
    return float(((p > 0.5) == labels).double().mean())


def _ece(p: torch.Tensor, labels: torch.Tensor) -> float:
    """Expected calibration error: |mean p - positive rate| over ten equal-width bins, by bin size."""
    bins = torch.clamp((p * ECE_BINS).long(), max=ECE_BINS - 1)
    total = 0.0
    for b in torch.unique(bins):
        inside = bins == b
        total += float(inside.sum()) * abs(float(p[inside].mean()) - float(labels[inside].double().mean()))
    return total / len(p)


def _balanced(labels: torch.Tensor) -> torch.Tensor:
    """Per-text weights: each class sums to one half."""
    counts = {side: int((labels == side).sum()) for side in (True, False)}
    return torch.tensor([0.5 / counts[bool(label)] for label in labels], dtype=torch.float64)


def _logistic(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, l2: float) -> torch.Tensor:
    """[features + 1] (weights, then bias) minimising the weighted log loss plus l2/2 |w|^2 (the
    bias unpenalised), by Newton's method: the problem is convex and small."""
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    penalty = torch.full((design.shape[1],), l2, dtype=x.dtype)
    penalty[-1] = 0.0
    theta = torch.zeros(design.shape[1], dtype=x.dtype)
    for _ in range(50):
        p = torch.sigmoid(design @ theta)
        gradient = design.T @ (weights * (p - y)) + penalty * theta
        hessian = (design.T * (weights * p * (1 - p))) @ design + torch.diag(penalty + 1e-12)
        step = torch.linalg.solve(hessian, gradient)
        theta -= step
        if float(step.abs().max()) < 1e-10:
            break
    return theta
