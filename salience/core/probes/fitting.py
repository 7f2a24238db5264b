"""Concept directions and their calibrations, fitted from labelled texts and validated on held-out ones.

Theory of operation. A concept is given as positive and negative example texts, optionally
in matched pairs (a positive and a negative that differ only in the concept), and the builder
may add **background** texts: ordinary text of several domains that shows neither side. Each
text contributes its residuals at every read layer, one row per token after the first (the
first token's residual is an attention sink, orders of magnitude larger than the rest, and
says nothing about the text). At one layer:

- A **direction** d (unit length) is fitted from the example texts only (never the background),
  by one of two methods: `diff_means`, the difference of the class means of per-text mean
  residuals; or `logreg`, an L2-regularised logistic regression on the per-text mean
  residuals, standardised per dimension, mapped back to the residual's own coordinates. The
  readout is <h, d>.
- Two **calibrations** map readouts to probabilities, each p = 1 / (1 + exp(-(scale * x + offset))),
  each a logistic regression with every text weighing the same whatever its length, positives
  one half, negatives the other (a quarter for the concept's negatives and a quarter for the
  background when there is one):
  - `token`: x is one token's readout, labelled with its text's class: p that this token
    belongs to a text with the concept.
  - `running`: x is the mean readout over the tokens so far (the first left out), labelled with
    the text's class at every prefix, a text's weight shared among its prefixes in proportion
    to their length: p that the text so far has the concept. On a text's last token this is
    the **text's score**.
  Calibrating the running mean directly, rather than averaging token probabilities, is what
  validates better (held-out AUROC at least as high, and a probability that means what it
  says at every length): `token_mean_auroc` publishes the other way's AUROC beside it.

Validation (`validate`) takes the folds `validation.folds` deals: every text is held out exactly
once, scored by a direction and calibrations fitted without it, and the figures of
probes/validation.py (what `concept_info` publishes, and what picks the recommended layer) are
computed over all held-out scores. The directions and calibrations that are stored are then
refitted on every text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from salience.core.probes import validation

__all__ = [
    "METHODS",
    "Calibration",
    "Residuals",
    "calibrate",
    "calibrate_running",
    "cross_validate",
    "fit_direction",
    "logit_lens",
    "running_means",
    "validate",
]

METHODS = ("diff_means", "logreg")
LOGREG_L2 = 1e-2  # on standardised per-text means: enough for a few dozen texts in hundreds of dimensions
CALIBRATION_L2 = 1e-3  # on the standardised readout: keeps the scale finite when the classes separate
BACKGROUND_SHARE = 0.5  # of the negative side's weight, when there is a background


@dataclass(frozen=True)
class Residuals:
    """One concept's texts at one layer: every token row, which text it belongs to (each text's
    rows contiguous and in order), each text's class, and which texts are background."""

    rows: torch.Tensor  # [tokens, hidden] float64
    text: torch.Tensor  # [tokens] int64: the index of the row's text
    labels: torch.Tensor  # [texts] bool: positive or not
    background: torch.Tensor | None = None  # [texts] bool: ordinary text (labelled negative)

    @property
    def texts(self) -> int:
        return len(self.labels)

    @property
    def ordinary(self) -> torch.Tensor:
        """[texts] bool: the background texts (none without a background)."""
        return torch.zeros_like(self.labels) if self.background is None else self.background

    def means(self) -> torch.Tensor:
        """[texts, hidden]: each text's mean residual (taken once: read only)."""
        return self._means

    @functools.cached_property
    def _means(self) -> torch.Tensor:
        sums = torch.zeros(self.texts, self.rows.shape[1], dtype=self.rows.dtype).index_add_(0, self.text, self.rows)
        return sums / torch.bincount(self.text, minlength=self.texts).clamp(min=1).unsqueeze(1).to(self.rows.dtype)

    def subset(self, keep: torch.Tensor) -> Residuals:
        """The texts `keep` (a [texts] bool mask) names, renumbered in order."""
        renumber = torch.cumsum(keep.long(), 0) - 1
        rows = keep[self.text]
        background = None if self.background is None else self.background[keep]
        return Residuals(self.rows[rows], renumber[self.text[rows]], self.labels[keep], background)

    def examples(self) -> Residuals:
        """The concept's own texts, without the background: what a direction is fitted on."""
        return self if self.background is None else self.subset(~self.background)


@dataclass(frozen=True)
class Calibration:
    scale: float
    offset: float

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.scale * raw + self.offset)


def fit_direction(method: str, data: Residuals, l2: float = LOGREG_L2) -> torch.Tensor:
    """The unit direction [hidden] that separates the classes, positive side up."""
    return _direction(method, data.means(), data.labels, data.ordinary, l2)


def _direction(
    method: str, means: torch.Tensor, labels: torch.Tensor, ordinary: torch.Tensor, l2: float = LOGREG_L2
) -> torch.Tensor:
    """fit_direction from per-text means [texts, hidden], their classes and which are background."""
    if method == "diff_means":
        direction = means[labels].mean(0) - means[~labels].mean(0)
    elif method == "logreg":
        center, spread = means.mean(0), means.std(0).clamp(min=1e-6)
        x = (means - center) / spread
        # Where the loss's gradient is zero, w = -x.T (weights * (p - y)) / l2: the optimum lies in
        # the span of the texts' rows, and so does every Newton step from zero. Solved in that span's
        # coordinates, the same steps take a (texts + 1)-square Hessian, not a (hidden + 1)-square one.
        span, within = torch.linalg.qr(x.T)  # x = within.T @ span.T, span orthonormal [hidden, k]
        theta = _logistic(within.T, labels.double(), _class_weights(labels, ordinary), l2)
        direction = (span @ theta[:-1]) / spread
    else:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    return direction / direction.norm()


def calibrate(raw: torch.Tensor, data: Residuals) -> Calibration:
    """The token view: the logistic map from a token's readout to its text's class, every text
    weighing the same, shared evenly among its tokens."""
    return _calibrations(raw.unsqueeze(1), data, _every_text(data), _token_share(data))[0]


def calibrate_running(raw: torch.Tensor, data: Residuals) -> Calibration:
    """The running view: the logistic map from the mean readout over a text's tokens so far to
    the text's class. Every text weighs the same, shared among its prefixes in proportion to
    their length: a prefix of t tokens holds t tokens of evidence, and the whole text (what is
    validated) weighs most."""
    x = running_means(raw, data.text).unsqueeze(1)
    return _calibrations(x, data, _every_text(data), _running_share(data))[0]


def running_means(raw: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """[tokens]: each token's mean readout over its text's tokens up to and including it."""
    lengths = torch.bincount(text)
    first = torch.cumsum(lengths, 0) - lengths
    sums = torch.cumsum(raw, 0)
    before = torch.cat([sums.new_zeros(1), sums])[first[text]]
    return (sums - before) / _within(text).to(raw.dtype)


def _within(text: torch.Tensor) -> torch.Tensor:
    """[tokens]: each token's 1-based position within its text (rows contiguous, in order)."""
    lengths = torch.bincount(text)
    return torch.arange(len(text)) - (torch.cumsum(lengths, 0) - lengths)[text] + 1


def _token_share(data: Residuals) -> torch.Tensor:
    """[tokens]: a token's part of its text's weight in the token view, one over its length."""
    return 1.0 / torch.bincount(data.text, minlength=data.texts)[data.text]


def _running_share(data: Residuals) -> torch.Tensor:
    """[tokens]: a prefix's part of its text's weight in the running view, in proportion to its length."""
    lengths = torch.bincount(data.text, minlength=data.texts)
    return _within(data.text).double() / (lengths * (lengths + 1) / 2)[data.text]


def _every_text(data: Residuals) -> torch.Tensor:
    return torch.ones(1, data.texts, dtype=torch.bool)


def _calibrations(x: torch.Tensor, data: Residuals, fitted: torch.Tensor, share: torch.Tensor) -> list[Calibration]:
    """One calibration per column of x ([tokens, fits]: each fit's value at every row), fitted on
    the texts its row of `fitted` ([fits, texts] bool) names: a logistic regression of each row's
    text class on x, a row weighing its text's balanced weight among those texts times `share`
    (its part within the text). The fits are solved together, other texts' rows weighing nothing."""
    inside = fitted[:, data.text].T  # [tokens, fits]
    weights = torch.zeros(fitted.shape, dtype=torch.float64)
    for weight, texts in zip(weights, fitted, strict=True):
        weight[texts] = _class_weights(data.labels[texts], data.ordinary[texts])
    # Standardise so one Newton solve suits readouts of any magnitude, then undo it.
    count = inside.sum(0)
    center = (x * inside).sum(0) / count
    spread = ((((x - center) ** 2) * inside).sum(0) / (count - 1)).sqrt().clamp(min=1e-12)
    labels = data.labels[data.text].double().expand(x.shape[1], -1)
    standard = ((x - center) / spread).T.unsqueeze(2)  # [fits, tokens, 1]
    theta = _logistic(standard, labels, weights[:, data.text] * share, CALIBRATION_L2)
    scale, offset = theta[:, 0], theta[:, 1]
    return [
        Calibration(scale=float(a), offset=float(b))
        for a, b in zip(scale / spread, offset - scale * center / spread, strict=True)
    ]


def cross_validate(method: str, layer: int, data: Residuals, fold: torch.Tensor) -> validation.LayerFit:
    """Held-out figures over every fold, and the calibrations of the direction refitted on every text."""
    return validate(method, layer, data, fold)[0]


def validate(method: str, layer: int, data: Residuals, fold: torch.Tensor) -> tuple[validation.LayerFit, torch.Tensor]:
    """cross_validate's figures and calibrations, with the direction [hidden] refitted on every text.

    Every direction is fitted from the texts' means, taken once; the rows are projected onto all of
    them in one product, and a fold's calibrations see only its texts' readouts (one column each)."""
    k = int(fold.max()) + 1
    means, own = data.means(), ~data.ordinary
    fitted = torch.stack([fold != f for f in range(k)] + [torch.ones_like(own)])  # [k + 1, texts]
    directions = torch.stack(
        [_direction(method, means[t & own], data.labels[t & own], data.ordinary[t & own]) for t in fitted], 1
    )
    raw = data.rows @ directions  # [tokens, k + 1]: each fold's readouts, then the final fit's
    running_raw = torch.stack([running_means(raw[:, f], data.text) for f in range(k + 1)], 1)
    token = _calibrations(raw, data, fitted, _token_share(data))
    running = _calibrations(running_raw, data, fitted, _running_share(data))
    token_p = torch.empty(len(data.rows), dtype=torch.float64)
    running_p = torch.empty(len(data.rows), dtype=torch.float64)
    for f in range(k):
        held = (fold == f)[data.text]
        token_p[held] = token[f](raw[held, f])
        running_p[held] = running[f](running_raw[held, f])
    lengths = torch.bincount(data.text, minlength=data.texts)
    score = running_p[torch.cumsum(lengths, 0) - 1]  # each text's last token
    mean_token_p = torch.zeros(data.texts, dtype=torch.float64).index_add_(0, data.text, token_p) / lengths
    tokens = own[data.text]
    token_labels = data.labels[data.text][tokens]
    intervals = validation.bootstrap(score, data.labels, data.ordinary)
    background = int(data.ordinary.sum())
    return validation.LayerFit(
        layer=layer,
        scale=token[k].scale,
        offset=token[k].offset,
        running_scale=running[k].scale,
        running_offset=running[k].offset,
        auroc=validation.auroc(score[own], data.labels[own]),
        auroc_interval=intervals["auroc"],
        accuracy=validation.accuracy(score[own], data.labels[own]),
        accuracy_interval=intervals["accuracy"],
        token_auroc=validation.auroc(token_p[tokens], token_labels),
        token_accuracy=validation.accuracy(token_p[tokens], token_labels),
        running_token_auroc=validation.auroc(running_p[tokens], token_labels),
        token_mean_auroc=validation.auroc(mean_token_p[own], data.labels[own]),
        brier=float(((token_p[tokens] - token_labels.double()) ** 2).mean()),
        ece=validation.ece(token_p[tokens], token_labels),
        background_fpr=float((score[data.ordinary] > 0.5).double().mean()) if background else None,
        background_fpr_interval=intervals.get("background_fpr"),
        background_texts=background,
    ), directions[:, k]


def logit_lens(normed: torch.Tensor, unembedding: torch.Tensor, k: int = 10):
    """The token ids a direction raises most and lowers most (k each, strongest first): `normed`
    is the direction as the final norm passes it on (Family.norm_scale), through the unembedding.
    What the model does after (Gemma 2's soft-cap, Granite's logit scaling) is monotonic per
    token and changes no ranking."""
    logits = unembedding.double() @ normed.double()
    return torch.topk(logits, k).indices.tolist(), torch.topk(-logits, k).indices.tolist()


def _class_weights(labels: torch.Tensor, ordinary: torch.Tensor) -> torch.Tensor:
    """Per-text weights: positives sum to one half, negatives to the other; with a background
    (`ordinary`), it takes BACKGROUND_SHARE of the negatives' half."""
    groups = (labels, ~labels & ~ordinary, ordinary)
    shares = (0.5, 0.5 * (1 - BACKGROUND_SHARE), 0.5 * BACKGROUND_SHARE) if ordinary.any() else (0.5, 0.5, 0.0)
    weights = torch.zeros(len(labels), dtype=torch.float64)
    for members, share in zip(groups, shares, strict=True):
        if members.any():
            weights[members] = share / int(members.sum())
    return weights


def _logistic(x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, l2: float) -> torch.Tensor:
    """[..., features + 1] (weights, then bias) minimising the weighted log loss plus l2/2 |w|^2 (the
    bias unpenalised), by Newton's method: the problem is convex and small. x [..., rows, features],
    y and weights [..., rows]: a batch of problems steps together until the last has converged (a
    converged problem's further steps are below the tolerance)."""
    design = torch.cat([x, x.new_ones(*x.shape[:-1], 1)], -1)
    penalty = torch.full((design.shape[-1],), l2, dtype=x.dtype)
    penalty[-1] = 0.0
    theta = x.new_zeros(*design.shape[:-2], design.shape[-1])
    for _ in range(50):
        p = torch.sigmoid((design @ theta.unsqueeze(-1)).squeeze(-1))
        gradient = (design.mT @ (weights * (p - y)).unsqueeze(-1)).squeeze(-1) + penalty * theta
        hessian = (design.mT * (weights * p * (1 - p)).unsqueeze(-2)) @ design + torch.diag(penalty + 1e-12)
        step = torch.linalg.solve(hessian, gradient)
        theta -= step
        if float(step.abs().max()) < 1e-10:
            break
    return theta
