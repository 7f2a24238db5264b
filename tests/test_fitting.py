"""The concept builder's fitting and validation math (core/probes/fitting.py, validation.py) against
independent references: scikit-learn's logistic regression and AUROC, and direct computations.
No engine needed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from salience.core.probes import fitting, validation


def _concept(
    texts: int = 60, hidden: int = 32, signal: float = 1.5, seed: int = 0, loud: float = 4.0
) -> fitting.Residuals:
    """Texts of 3-12 tokens whose residuals lean along one direction when positive, plus an offset
    and one uninformative dimension `loud` times as noisy as the rest, as real residual streams have."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(texts) % 3 != 0  # unbalanced on purpose: 2 positives per negative
    lengths = torch.randint(3, 13, (texts,), generator=generator)
    text = torch.repeat_interleave(torch.arange(texts), lengths)
    direction = torch.randn(hidden, generator=generator, dtype=torch.float64)
    rows = torch.randn(len(text), hidden, generator=generator, dtype=torch.float64)
    rows += signal * labels[text].double().unsqueeze(1) * direction / direction.norm()
    rows[:, 0] = rows[:, 0] * loud + 100
    return fitting.Residuals(rows, text, labels)


def _balanced(labels: np.ndarray) -> np.ndarray:
    return np.where(labels, 0.5 / labels.sum(), 0.5 / (~labels).sum())


def test_auroc_counts_pairs() -> None:
    generator = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 6, (40,), generator=generator).double()  # many ties
    labels = torch.rand(40, generator=generator) > 0.5
    pairs = [
        1.0 if p > n else 0.5 if p == n else 0.0
        for p, n in itertools.product(scores[labels].tolist(), scores[~labels].tolist())
    ]
    assert validation.auroc(scores, labels) == pytest.approx(sum(pairs) / len(pairs), abs=1e-12)
    assert validation.auroc(scores, labels) == pytest.approx(roc_auc_score(labels.numpy(), scores.numpy()), abs=1e-12)


def test_difference_of_means_is_of_text_means() -> None:
    data = _concept()
    means = np.stack([data.rows[data.text == t].mean(0).numpy() for t in range(data.texts)])
    labels = data.labels.numpy()
    expected = means[labels].mean(0) - means[~labels].mean(0)
    got = fitting.fit_direction("diff_means", data).numpy()
    np.testing.assert_allclose(got, expected / np.linalg.norm(expected), rtol=1e-10, atol=1e-12)


def test_logistic_direction_matches_scikit_learn() -> None:
    _assert_logistic_matches_scikit_learn(_concept())


def _assert_logistic_matches_scikit_learn(data) -> None:
    means = np.stack([data.rows[data.text == t].mean(0).numpy() for t in range(data.texts)])
    labels = data.labels.numpy()
    standardised = (means - means.mean(0)) / means.std(0, ddof=1)
    # sklearn minimises C * sum(w_i * loss_i) + |coef|^2 / 2; ours sum(w_i * loss_i) + l2 |coef|^2 / 2.
    reference = LogisticRegression(C=1 / fitting.LOGREG_L2, tol=1e-12, max_iter=10_000)
    reference.fit(standardised, labels, sample_weight=_balanced(labels))
    expected = reference.coef_[0] / means.std(0, ddof=1)
    got = fitting.fit_direction("logreg", data).numpy()
    np.testing.assert_allclose(got, expected / np.linalg.norm(expected), atol=1e-5)


def test_calibration_matches_scikit_learn_on_token_readouts() -> None:
    data = _concept()
    direction = fitting.fit_direction("diff_means", data)
    raw = (data.rows @ direction).numpy()
    token_labels = data.labels[data.text].numpy()
    lengths = np.bincount(data.text.numpy())
    weights = _balanced(data.labels.numpy())[data.text.numpy()] / lengths[data.text.numpy()]
    center, spread = raw.mean(), raw.std(ddof=1)
    reference = LogisticRegression(C=1 / fitting.CALIBRATION_L2, tol=1e-12, max_iter=10_000)
    reference.fit(((raw - center) / spread)[:, None], token_labels, sample_weight=weights)
    got = fitting.calibrate(torch.from_numpy(raw), data)
    expected = reference.predict_proba(((raw - center) / spread)[:, None])[:, 1]
    np.testing.assert_allclose(got(torch.from_numpy(raw)).numpy(), expected, atol=1e-6)
    assert got(torch.tensor(-got.offset / got.scale)).item() == pytest.approx(0.5)


def test_folds_are_stratified_and_seeded() -> None:
    labels = torch.arange(50) % 5 != 0
    fold = validation.folds(labels, 5, seed=7)
    assert torch.equal(fold, validation.folds(labels, 5, seed=7))
    assert not torch.equal(fold, validation.folds(labels, 5, seed=8))
    for f in range(5):
        assert int((labels & (fold == f)).sum()) == 8 and int((~labels & (fold == f)).sum()) == 2


def test_cross_validation_holds_each_text_out() -> None:
    """Held-out figures of a separable concept are high, of a concept with no signal near chance;
    and a text's held-out score never comes from a fit that saw it."""
    for method in fitting.METHODS:
        strong = fitting.cross_validate(method, 4, _concept(signal=3.0), validation.folds(_concept().labels, 5, 0))
        assert strong.auroc > 0.95 and strong.accuracy > 0.85 and strong.layer == 4
        noise = fitting.cross_validate(method, 4, _concept(signal=0.0), validation.folds(_concept().labels, 5, 0))
        assert 0.2 < noise.auroc < 0.8, noise
    # Memorising would show: with as many dimensions as texts, fitting on all texts separates them
    # perfectly, but held-out scores of pure noise stay near chance.
    wide = _concept(texts=30, hidden=64, signal=0.0)
    fit_on_all = fitting.fit_direction("logreg", wide)
    assert validation.auroc(wide.means() @ fit_on_all, wide.labels) > 0.95
    assert fitting.cross_validate("logreg", 0, wide, validation.folds(wide.labels, 5, 0)).auroc < 0.8


def test_best_layer_prefers_text_auroc_less_false_positives_then_token_auroc_then_earlier() -> None:
    def fit(layer: int, auroc: float, token_auroc: float, fpr: float | None = None) -> validation.LayerFit:
        return validation.LayerFit(
            layer=layer, scale=1, offset=0, running_scale=1, running_offset=0, auroc=auroc,
            auroc_interval=(auroc, auroc), accuracy=1, accuracy_interval=(1, 1), token_auroc=token_auroc,
            token_accuracy=1, running_token_auroc=token_auroc, token_mean_auroc=auroc, brier=0, ece=0,
            background_fpr=fpr,
        )  # fmt: skip

    assert validation.best_layer([fit(0, 0.9, 0.9), fit(1, 0.95, 0.5), fit(2, 0.95, 0.6)]).layer == 2
    assert validation.best_layer([fit(3, 1.0, 0.8), fit(1, 1.0, 0.8)]).layer == 1
    # Less the background's false positives: a layer that fires on ordinary text loses.
    assert validation.best_layer([fit(0, 1.0, 0.9, 0.3), fit(1, 0.98, 0.8, 0.0)]).layer == 1


def test_logistic_regression_sees_past_a_loud_dimension() -> None:
    """Why `logreg` is offered: one dimension with noise far above the rest (as residual streams
    have) swamps a difference of means, not a regression on standardised features."""
    data = _concept(texts=150, signal=3.0, loud=40.0)
    fold = validation.folds(data.labels, 5, 0)
    assert fitting.cross_validate("logreg", 0, data, fold).auroc > 0.95
    assert fitting.cross_validate("diff_means", 0, data, fold).auroc < 0.8


def _with_background(data: fitting.Residuals, texts: int = 30, shift: float = 0.0, seed: int = 1) -> fitting.Residuals:
    """`data` plus `texts` background texts of 3-12 tokens: noise, moved `shift` along the first
    positive text's mean (ordinary text that leans toward the concept when shift > 0)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 13, (texts,), generator=generator)
    rows = torch.randn(int(lengths.sum()), data.rows.shape[1], generator=generator, dtype=torch.float64)
    lean = data.means()[data.labels].mean(0) - data.means()[~data.labels].mean(0)
    rows += shift * lean / lean.norm()
    rows[:, 0] = rows[:, 0] * 4.0 + 100
    text = torch.repeat_interleave(torch.arange(texts), lengths) + data.texts
    return fitting.Residuals(
        torch.cat([data.rows, rows]),
        torch.cat([data.text, text]),
        torch.cat([data.labels, torch.zeros(texts, dtype=torch.bool)]),
        torch.cat([torch.zeros(data.texts, dtype=torch.bool), torch.ones(texts, dtype=torch.bool)]),
    )


def test_running_means_are_each_texts_prefix_means() -> None:
    data = _concept()
    raw = data.rows[:, 1]
    got = fitting.running_means(raw, data.text)
    for t in range(data.texts):
        mine = raw[data.text == t].numpy()
        np.testing.assert_allclose(got[data.text == t].numpy(), np.cumsum(mine) / np.arange(1, len(mine) + 1))


def test_running_calibration_matches_scikit_learn_on_prefix_means() -> None:
    """Every prefix of a text labelled with its class, the text's weight shared among its prefixes in
    proportion to their length, positives half, the concept's negatives a quarter and the background
    a quarter."""
    data = _with_background(_concept(), shift=0.5)
    raw = (data.rows @ fitting.fit_direction("diff_means", data.examples())).numpy()
    text, labels, ordinary = data.text.numpy(), data.labels.numpy(), data.ordinary.numpy()
    x = np.concatenate([np.cumsum(raw[text == t]) / np.arange(1, (text == t).sum() + 1) for t in range(data.texts)])
    per_text = np.where(
        labels, 0.5 / labels.sum(), np.where(ordinary, 0.25 / ordinary.sum(), 0.25 / (~labels & ~ordinary).sum())
    )
    t = np.concatenate([np.arange(1, (text == i).sum() + 1) for i in range(data.texts)])
    n = np.bincount(text)[text]
    weights = per_text[text] * t / (n * (n + 1) / 2)  # a prefix's share of its text grows with its length
    center, spread = x.mean(), x.std(ddof=1)
    reference = LogisticRegression(C=1 / fitting.CALIBRATION_L2, tol=1e-12, max_iter=10_000)
    reference.fit(((x - center) / spread)[:, None], labels[text], sample_weight=weights)
    got = fitting.calibrate_running(torch.from_numpy(raw), data)
    expected = reference.predict_proba(((x - center) / spread)[:, None])[:, 1]
    np.testing.assert_allclose(got(torch.from_numpy(x)).numpy(), expected, atol=1e-6)


def test_folds_keep_pairs_together_and_deal_the_background() -> None:
    labels = torch.tensor([True, False] * 20 + [True] * 6 + [False] * 4 + [False] * 15)
    pairs = torch.tensor([i // 2 for i in range(40)] + [-1] * 25)
    background = torch.tensor([False] * 50 + [True] * 15)
    fold = validation.folds(labels, 5, 0, pairs=pairs, background=background)
    assert torch.equal(fold[0:40:2], fold[1:40:2])  # each pair in one fold
    assert sorted(torch.bincount(fold[background]).tolist()) == [3] * 5
    per_fold = torch.bincount(fold[~background & labels], minlength=5)
    assert int(per_fold.max() - per_fold.min()) <= 1


def test_background_false_positives_are_held_out_and_calibrated_away() -> None:
    """Background texts move the calibration, never the direction; the false-positive rate counts
    held-out background texts scoring above 0.5."""
    data = _concept(signal=3.0)
    plain = _with_background(data, shift=0.0)
    fold = validation.folds(plain.labels, 5, 0, background=plain.background)
    fit = fitting.cross_validate("diff_means", 0, plain, fold)
    assert fit.background_texts == 30 and fit.background_fpr is not None and fit.background_fpr <= 0.1
    assert torch.allclose(
        fitting.fit_direction("diff_means", plain.examples()), fitting.fit_direction("diff_means", data)
    )
    # Background leaning halfway to the positives reads positive more often, and the figure says so.
    leaning = _with_background(data, shift=6.0)
    worse = fitting.cross_validate(
        "diff_means", 0, leaning, validation.folds(leaning.labels, 5, 0, background=leaning.background)
    )
    assert worse.background_fpr > fit.background_fpr
    lo, hi = worse.background_fpr_interval
    assert lo <= worse.background_fpr <= hi


def test_bootstrap_intervals_resample_texts_within_each_class() -> None:
    """The vectorised bootstrap equals the figures recomputed on each resample, drawn the same way."""
    generator = torch.Generator().manual_seed(5)
    labels = torch.arange(40) % 2 == 0
    background = torch.arange(40) >= 30
    labels &= ~background
    score = torch.rand(40, generator=generator, dtype=torch.float64) * 0.6 + labels.double() * 0.3
    got = validation.bootstrap(score, labels, background, samples=200)
    draws = torch.Generator().manual_seed(0)
    groups = [score[~background & labels], score[~background & ~labels], score[background]]
    picks = [g[torch.randint(0, len(g), (200, len(g)), generator=draws)] for g in groups]
    aurocs, accuracies, fprs = [], [], []
    for pos, neg, bg in zip(*picks, strict=True):
        both = torch.cat([pos, neg])
        truth = torch.cat([torch.ones(len(pos), dtype=torch.bool), torch.zeros(len(neg), dtype=torch.bool)])
        aurocs.append(validation.auroc(both, truth))
        accuracies.append(float(((both > 0.5) == truth).double().mean()))
        fprs.append(float((bg > 0.5).double().mean()))
    for name, values in (("auroc", aurocs), ("accuracy", accuracies), ("background_fpr", fprs)):
        expected = np.quantile(np.array(values), [0.025, 0.975])
        np.testing.assert_allclose(got[name], expected, atol=1e-12, err_msg=name)


def test_logistic_direction_with_more_dimensions_than_texts_matches_scikit_learn() -> None:
    """As residual streams are read: fewer texts than dimensions, where the fit solves within the
    span of the texts' means."""
    _assert_logistic_matches_scikit_learn(_concept(texts=40, hidden=96))


@pytest.mark.parametrize("method", fitting.METHODS)
def test_validation_scores_each_text_as_its_fold_fitted_on_its_own(method: str) -> None:
    """validate fits every fold together (one product for all directions, one Newton solve per view
    for all calibrations); each held-out text must score as the public functions fitted on its
    fold's texts alone score it, and the stored fit must be theirs on every text."""
    data = _with_background(_concept(signal=1.0), shift=0.5)
    fold = validation.folds(data.labels, 5, 0, background=data.background)
    fit, direction = fitting.validate(method, 7, data, fold)
    token_p = torch.empty(len(data.rows), dtype=torch.float64)
    running_p = torch.empty(len(data.rows), dtype=torch.float64)
    for f in range(5):
        part = data.subset(fold != f)
        fitted = fitting.fit_direction(method, part.examples())
        held = (fold == f)[data.text]
        raw = data.rows @ fitted
        token_p[held] = fitting.calibrate(part.rows @ fitted, part)(raw[held])
        running_p[held] = fitting.calibrate_running(part.rows @ fitted, part)(
            fitting.running_means(raw, data.text)[held]
        )
    own = ~data.ordinary
    score = running_p[torch.cumsum(torch.bincount(data.text), 0) - 1]
    tokens = own[data.text]
    token_labels = data.labels[data.text][tokens]
    assert fit.layer == 7 and fit.background_texts == 30
    assert fit.auroc == pytest.approx(validation.auroc(score[own], data.labels[own]), abs=1e-12)
    assert fit.background_fpr == pytest.approx(float((score[data.ordinary] > 0.5).double().mean()), abs=1e-12)
    assert fit.token_auroc == pytest.approx(validation.auroc(token_p[tokens], token_labels), abs=1e-12)
    assert fit.running_token_auroc == pytest.approx(validation.auroc(running_p[tokens], token_labels), abs=1e-12)
    assert fit.brier == pytest.approx(float(((token_p[tokens] - token_labels.double()) ** 2).mean()), abs=1e-12)
    final = fitting.fit_direction(method, data.examples())
    torch.testing.assert_close(direction, final, rtol=0, atol=1e-12)
    token, running = fitting.calibrate(data.rows @ final, data), fitting.calibrate_running(data.rows @ final, data)
    assert (fit.scale, fit.offset) == pytest.approx((token.scale, token.offset), rel=1e-9)
    assert (fit.running_scale, fit.running_offset) == pytest.approx((running.scale, running.offset), rel=1e-9)
