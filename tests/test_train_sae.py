"""tools/sae_training.py on synthetic data drawn from a known sparse dictionary: the training
recovers it, and the numbers it reports are the ones a direct computation gives. No capture, no
vLLM: tools/train_sae.py's docstring has the figures of a real run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from salience.core.features.sae import load_sae, save_sae
from tools.sae_training import TopKSAE, TrainConfig, _Decoded, _Gathered, evaluate, fraction_variance_explained, train

D_IN, TRUE_FEATURES, K = 32, 64, 4


def sparse_data(rows: int, generator: torch.Generator, dictionary: torch.Tensor) -> torch.Tensor:
    """K of the dictionary's unit directions per row, magnitudes in [0.5, 2.5], far from the origin
    and at a scale far from 1 (so the input scaling and b_dec both matter)."""
    chosen = torch.rand(rows, TRUE_FEATURES, generator=generator).argsort(dim=1)[:, :K]
    magnitudes = 0.5 + 2 * torch.rand(rows, K, generator=generator)
    codes = torch.zeros(rows, TRUE_FEATURES).scatter_(1, chosen, magnitudes)
    return 30 * (codes @ dictionary) + 5.0


@pytest.fixture(scope="module")
def trained():
    generator = torch.Generator().manual_seed(0)
    dictionary = F.normalize(torch.randn(TRUE_FEATURES, D_IN, generator=generator), dim=1)
    x = sparse_data(16384, generator, dictionary)
    heldout = sparse_data(4096, generator, dictionary)
    config = TrainConfig(expansion=4, k=K, epochs=12, batch=256, lr=3e-3, dead_tokens=4096, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small: a second thread only waits (10x longer on a busy machine)
    try:
        return train(x, config, progress=False), heldout
    finally:
        torch.set_num_threads(threads)


def test_recovers_a_sparse_dictionary(trained) -> None:
    result, heldout = trained
    metrics = evaluate(result.sae, heldout)
    assert metrics.fve > 0.9
    assert metrics.l0 <= K
    assert result.sae.W_dec.norm(dim=1).sub(1).abs().max() < 1e-5  # unit rows, kept after the fold
    assert result.train_fve > 0.9


def test_metrics_match_a_direct_computation(trained) -> None:
    result, heldout = trained
    sae = result.sae
    latents = sae.latents(heldout)  # dense, through torch.topk: the model's own definition
    pre = (heldout - sae.b_dec) @ sae.W_enc + sae.b_enc
    kth = pre.topk(K, dim=1).values[:, -1:]
    assert torch.equal(latents > 0, (pre >= kth) & (pre > 0))
    x_hat = latents @ sae.W_dec + sae.b_dec
    direct_fve = 1 - ((heldout - x_hat) ** 2).sum() / ((heldout - heldout.mean(0)) ** 2).sum()
    metrics = evaluate(sae, heldout, batch=1000)  # batches that do not divide the rows
    assert metrics.fve == pytest.approx(direct_fve.item(), abs=1e-5)
    assert fraction_variance_explained(heldout, x_hat) == pytest.approx(direct_fve.item(), abs=1e-5)
    assert metrics.l0 == pytest.approx((latents > 0).sum(1).float().mean().item())
    assert torch.equal(metrics.fired, (latents > 0).any(0))
    assert metrics.dead_fraction == pytest.approx(1 - (latents > 0).any(0).float().mean().item())
    assert metrics.rows == heldout.shape[0]


def test_fve_of_known_reconstructions() -> None:
    x = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 2.0], [2.0, -2.0]])  # mean (2, 0); sum ||x - mean||² = 10
    assert fraction_variance_explained(x, x) == 1.0
    assert fraction_variance_explained(x, x.mean(0).expand_as(x)) == pytest.approx(0.0)
    assert fraction_variance_explained(x, x + torch.tensor([1.0, 0.0])) == pytest.approx(1 - 4 / 10)


def test_saved_folder_reads_the_same(trained, tmp_path) -> None:
    """What the tool saves is what the server loads: same latents and reconstructions."""
    result, heldout = trained
    sae = result.sae
    save_sae(
        tmp_path / "sae",
        architecture="topk",
        layer=3,
        W_enc=sae.W_enc,
        b_enc=sae.b_enc,
        W_dec=sae.W_dec,
        b_dec=sae.b_dec,
        k=K,
        model_name="synthetic",
    )
    loaded = load_sae(tmp_path / "sae")
    latents = loaded.encode(heldout[:512])
    torch.testing.assert_close(latents, sae.latents(heldout[:512]))
    torch.testing.assert_close(loaded.decode(latents), sae.decode(*sae.encode(heldout[:512])), rtol=1e-5, atol=1e-4)


def test_sparse_backward_matches_dense_autograd() -> None:
    generator = torch.Generator().manual_seed(1)
    centred = torch.randn(16, 8, generator=generator, requires_grad=True)
    W_enc = torch.randn(24, 8, generator=generator, requires_grad=True)  # [d_sae, d_in], as trained
    b_enc = torch.randn(24, generator=generator, requires_grad=True)
    indices = torch.randn(16, 24, generator=generator).topk(5, dim=1).indices
    weights = torch.randn(16, 5, generator=generator)
    pre = torch.addmm(b_enc, centred, W_enc.T)
    (pre.gather(1, indices) * weights).sum().backward()
    dense = [t.grad.clone() for t in (centred, W_enc, b_enc)]
    for t in (centred, W_enc, b_enc):
        t.grad = None
    (_Gathered.apply(centred, W_enc, b_enc, pre.detach(), indices) * weights).sum().backward()
    for got, want in zip((centred.grad, W_enc.grad, b_enc.grad), dense, strict=True):
        torch.testing.assert_close(got, want)


def test_dense_and_sparse_decode_agree() -> None:
    generator = torch.Generator().manual_seed(2)
    sae = TopKSAE(
        torch.randn(8, 40, generator=generator),
        torch.randn(40, generator=generator),
        F.normalize(torch.randn(40, 8, generator=generator), dim=1),
        torch.randn(8, generator=generator),
        3,
    )
    x = torch.randn(10, 8, generator=generator)
    torch.testing.assert_close(sae.decode(*sae.encode(x)), sae.latents(x) @ sae.W_dec + sae.b_dec)


def test_sparse_decoder_backward_matches_dense_autograd() -> None:
    generator = torch.Generator().manual_seed(3)
    indices = torch.randn(16, 24, generator=generator).topk(5, dim=1, sorted=False).indices
    values = torch.rand(16, 5, generator=generator, requires_grad=True)
    W_dec = torch.randn(24, 8, generator=generator, requires_grad=True)
    target = torch.randn(16, 8, generator=generator)
    dense = torch.zeros(16, 24).scatter(1, indices, values) @ W_dec
    ((dense - target) ** 2).sum().backward()
    want = [values.grad.clone(), W_dec.grad.clone()]
    values.grad = W_dec.grad = None
    ((_Decoded.apply(indices, values, W_dec) - target) ** 2).sum().backward()
    torch.testing.assert_close(values.grad, want[0])
    torch.testing.assert_close(W_dec.grad, want[1])
