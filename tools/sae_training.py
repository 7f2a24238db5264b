"""A top-k sparse autoencoder trained in plain torch on CPU, and the numbers that judge it.

The model (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"; SAELens's `topk`):

    latents = relu(topk_k(W_encᵀ (x − b_dec) + b_enc))        W_enc [d_in, d_sae]
    x̂       = W_decᵀ latents + b_dec                          W_dec [d_sae, d_in], unit rows

Theory of operation. On two CPU cores the dense work is the one encoder matmul,
[batch, d_in] x [d_in, d_sae]; everything after the top-k touches k (or k_aux) latents per row:

- the encoder's backward (`_Gathered`) forms the gradient of the selected pre-activations as a
  sparse [batch, d_sae] matrix, so W_enc's gradient is one sparse x dense product, not a second
  dense matmul (OpenAI's sparse kernels do the same on GPU);
- the decoder (`_Decoded`) is `embedding_bag` over the selected rows of W_dec, weighted by the
  latents; its backward is a sparse x dense product for W_dec and a sampled one
  (`sampled_addmm`) for the latents, since embedding_bag's own backward sorts the indices, which
  on CPU costs more than the rest of a step.

A step of 4096 rows at width 4608 took 0.26 s on two quiet cores; on cores busy with other
work, 0.8 s with two threads and 0.45 s with one (a second thread mostly waits then).

Training, as in the paper: inputs scaled to a mean squared norm of d_in (the scale is folded back
into b_enc and b_dec when the model is returned, so the result reads raw activations, with the
same latents divided by the scale); b_dec starts at the geometric median of a sample, W_dec with
random unit rows and W_enc = W_decᵀ, scaled so that the first reconstructions have the inputs'
size; the loss is the batch's normalised MSE (1 − FVE) plus 1/32 of AuxK: the k_aux = d_in / 2
largest pre-activations among latents silent for `dead_tokens` rows reconstruct the residual
x − x̂ (normalised the same way, scaled down while fewer latents than k_aux are dead, as in
SAELens). The parallel component of W_dec's gradient is projected out and its rows renormalised
after each step. Adam (fused, which on CPU is 4x faster than the default loop), the learning
rate falling linearly to zero over the last fifth of the steps.

The learning rate is tuned, not the paper's: 2e-4 / sqrt(d_sae / 2^14) (3.8e-4 at width 4608) is
made for runs of billions of tokens, and here there are about a million rows seen. On the default
model's layer 15 (300K rows, width 4608, k 32, batches of 4096), held-out FVE after 6 epochs was
0.77 at 3.8e-4, 0.83 at 1e-3, 0.855 at 2e-3 and 0.866 at 4e-3 (where latents begin to die); after
4 epochs at 3e-3, 0.852 in half the time: the default (8 epochs gave 0.869, in 3 minutes instead
of 80 s). Batches of 1024 did better per step (0.85 in 4 epochs at 1e-3) but worse per second: a
step has costs of its own, as the update of all 5.3M parameters.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

__all__ = ["Metrics", "TopKSAE", "TrainConfig", "TrainResult", "evaluate", "fraction_variance_explained", "train"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    expansion: int = 8  # d_sae = expansion * d_in
    k: int = 32
    epochs: int = 4
    batch: int = 4096
    lr: float = 3e-3  # tuned for short runs: see the module docstring
    k_aux: int | None = None  # None: d_in // 2
    aux_coef: float = 1 / 32
    dead_tokens: int = 200_000  # a latent silent this long counts as dead, and AuxK trains it
    decay_fraction: float = 0.2  # the lr falls linearly to 0 over this last part of training
    seed: int = 0


@dataclass
class TopKSAE:
    W_enc: Tensor  # [d_in, d_sae]
    b_enc: Tensor  # [d_sae]
    W_dec: Tensor  # [d_sae, d_in]
    b_dec: Tensor  # [d_in]
    k: int

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The k selected latents of each row: indices [n, k] and values [n, k] (after the ReLU)."""
        values, indices = ((x - self.b_dec) @ self.W_enc + self.b_enc).topk(self.k, dim=1, sorted=False)
        return indices, values.relu()

    def decode(self, indices: Tensor, values: Tensor) -> Tensor:
        return F.embedding_bag(indices, self.W_dec, per_sample_weights=values, mode="sum") + self.b_dec

    def latents(self, x: Tensor) -> Tensor:
        """Dense [n, d_sae] latents."""
        indices, values = self.encode(x)
        return torch.zeros(x.shape[0], self.W_enc.shape[1], dtype=x.dtype).scatter_(1, indices, values)


@dataclass(frozen=True)
class Metrics:
    fve: float  # 1 - sum ||x - x̂||² / sum ||x - mean(x)||²
    l0: float  # mean number of non-zero latents per row
    fired: Tensor  # [d_sae] bool: the latent was non-zero on some row
    rows: int

    @property
    def dead_fraction(self) -> float:
        return 1.0 - self.fired.float().mean().item()


@dataclass
class TrainResult:
    sae: TopKSAE  # reads raw (unscaled) activations
    scale: float  # inputs were multiplied by this in training
    steps: int
    tokens: int  # rows seen, over all epochs
    seconds: float
    alive: Tensor  # [d_sae] bool: fired within the last `dead_tokens` rows of training
    train_fve: float  # over the last epoch's batches, as trained


def fraction_variance_explained(x: Tensor, x_hat: Tensor) -> float:
    x, x_hat = x.double(), x_hat.double()
    return 1.0 - ((x - x_hat) ** 2).sum().item() / ((x - x.mean(0)) ** 2).sum().item()


@torch.no_grad()
def evaluate(sae: TopKSAE, x: Tensor, batch: int = 4096) -> Metrics:
    """FVE, mean L0 and the latents that fired, over `x` in batches (sums kept in float64)."""
    error = 0.0
    total = torch.zeros(x.shape[1], dtype=torch.float64)
    squares = torch.zeros((), dtype=torch.float64)
    active = 0
    fired = torch.zeros(sae.W_enc.shape[1], dtype=torch.bool)
    for start in range(0, x.shape[0], batch):
        rows = x[start : start + batch]
        indices, values = sae.encode(rows)
        error += ((rows - sae.decode(indices, values)).double() ** 2).sum().item()
        total += rows.double().sum(0)
        squares += (rows.double() ** 2).sum()
        on = values > 0
        active += int(on.sum())
        fired[indices[on]] = True
    n = x.shape[0]
    variance = squares.item() - (total**2).sum().item() / n  # sum ||x - mean||²
    return Metrics(fve=1.0 - error / variance, l0=active / n, fired=fired, rows=n)


def _by_latent(indices: Tensor, values: Tensor, d_sae: int) -> Tensor:
    """The sparse [d_sae, n] matrix with values[i, j] at (indices[i, j], i)."""
    rows = torch.arange(indices.shape[0]).repeat_interleave(indices.shape[1])
    where = torch.stack([indices.flatten(), rows])
    return torch.sparse_coo_tensor(where, values.flatten(), (d_sae, indices.shape[0]), check_invariants=False)


class _Gathered(torch.autograd.Function):
    """`pre.gather(1, indices)`, where pre = centred @ W_encᵀ + b_enc (W_enc here [d_sae, d_in]) was
    computed without autograd: the backward only touches the gathered latents."""

    @staticmethod
    def forward(ctx, centred: Tensor, W_enc: Tensor, b_enc: Tensor, pre: Tensor, indices: Tensor) -> Tensor:
        ctx.save_for_backward(centred, W_enc, indices)
        return pre.gather(1, indices)

    @staticmethod
    def backward(ctx, grad: Tensor):
        centred, W_enc, indices = ctx.saved_tensors
        grad_W = torch.sparse.mm(_by_latent(indices, grad, W_enc.shape[0]), centred)
        grad_centred = F.embedding_bag(indices, W_enc, per_sample_weights=grad, mode="sum")
        grad_b = torch.zeros(W_enc.shape[0]).index_add_(0, indices.flatten(), grad.flatten())
        return grad_centred, grad_W, grad_b, None, None


class _Decoded(torch.autograd.Function):
    """sum_j values[:, j] * W_dec[indices[:, j]]. embedding_bag's own backward sorts the indices,
    which on CPU costs more than the rest of a step; here W_dec's gradient is a sparse x dense
    product and the values' a sampled one (only the pairs that were used)."""

    @staticmethod
    def forward(ctx, indices: Tensor, values: Tensor, W_dec: Tensor) -> Tensor:
        ctx.save_for_backward(indices, values, W_dec)
        return F.embedding_bag(indices, W_dec, per_sample_weights=values, mode="sum")

    @staticmethod
    def backward(ctx, grad: Tensor):
        indices, values, W_dec = ctx.saved_tensors
        n, per_row = indices.shape
        grad_W = torch.sparse.mm(_by_latent(indices, values, W_dec.shape[0]), grad)
        columns, order = indices.sort(dim=1)  # CSR wants each row's columns sorted
        rows = torch.arange(0, n * per_row + 1, per_row)
        with warnings.catch_warnings():  # "CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            pattern = torch.sparse_csr_tensor(
                rows, columns.flatten(), values.new_zeros(n * per_row), (n, W_dec.shape[0]), check_invariants=False
            )
        sampled = torch.sparse.sampled_addmm(pattern, grad, W_dec.T, beta=0.0).values().view(n, per_row)
        return None, torch.empty_like(sampled).scatter_(1, order, sampled), grad_W


def geometric_median(points: Tensor, iterations: int = 50) -> Tensor:
    """Weiszfeld's algorithm, from the mean."""
    median = points.mean(0)
    for _ in range(iterations):
        weights = 1.0 / (points - median).norm(dim=1).clamp_min(1e-8)
        median = (weights[:, None] * points).sum(0) / weights.sum()
    return median


def _normalised_mse(prediction: Tensor, target: Tensor) -> Tensor:
    return ((prediction - target) ** 2).sum() / ((target - target.mean(0)) ** 2).sum().clamp_min(1e-12)


def train(x: Tensor, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train a top-k SAE on the rows of `x` [n, d_in] (float32), `config.epochs` shuffled passes."""
    started = time.monotonic()
    generator = torch.Generator().manual_seed(config.seed)
    n, d_in = x.shape
    d_sae = config.expansion * d_in
    k_aux = config.k_aux or d_in // 2
    sample = x[torch.randperm(n, generator=generator)[:32768]]
    scale = math.sqrt(d_in / (sample**2).sum(1).mean().item())
    sample = sample * scale

    b_dec = geometric_median(sample)
    W_dec = F.normalize(torch.randn(d_sae, d_in, generator=generator), dim=1)
    W_enc = W_dec.clone()  # [d_sae, d_in]: W_encᵀ of the model, tied at the start
    with torch.no_grad():
        probe = TopKSAE(W_enc.T, torch.zeros(d_sae), W_dec, b_dec, config.k)
        reconstruction = probe.decode(*probe.encode(sample[:4096])) - b_dec
        W_enc *= (sample[:4096] - b_dec).norm(dim=1).mean() / reconstruction.norm(dim=1).mean()
    params = [p.requires_grad_() for p in (W_enc, torch.zeros(d_sae), W_dec, b_dec)]
    W_enc, b_enc, W_dec, b_dec = params
    lr = config.lr
    optimizer = torch.optim.Adam(params, lr=lr, fused=True)
    steps_per_epoch = max(1, n // config.batch)  # the last partial batch of each shuffle is dropped
    steps = steps_per_epoch * config.epochs
    decay_from = steps * (1 - config.decay_fraction)
    silent = torch.zeros(d_sae, dtype=torch.long)  # rows since each latent last fired
    epoch_error = epoch_variance = 0.0
    bar = tqdm(total=steps, desc="training SAE", unit="step", disable=not progress)
    step = 0
    for _epoch in range(config.epochs):
        order = torch.randperm(n, generator=generator)
        epoch_error = epoch_variance = 0.0
        for first in range(0, steps_per_epoch * config.batch, config.batch):
            batch = x[order[first : first + config.batch]] * scale
            dead = silent >= config.dead_tokens
            centred = batch - b_dec
            with torch.no_grad():
                pre = torch.addmm(b_enc, centred, W_enc.T)
                top = pre.topk(config.k, dim=1, sorted=False).indices
                dead_count = int(dead.sum())
                chosen = top
                if dead_count:
                    aux = pre.masked_fill(~dead, -math.inf).topk(min(k_aux, dead_count), dim=1, sorted=False).indices
                    chosen = torch.cat([top, aux], dim=1)
            values = _Gathered.apply(centred, W_enc, b_enc, pre, chosen).relu()
            latents = values[:, : config.k]
            reconstruction = _Decoded.apply(top, latents, W_dec) + b_dec
            error = ((reconstruction - batch) ** 2).sum()
            variance = ((batch - batch.mean(0)) ** 2).sum()
            loss = error / variance
            if dead_count:
                residual = (batch - reconstruction).detach()
                aux_values = values[:, config.k :]
                aux_reconstruction = _Decoded.apply(chosen[:, config.k :], aux_values, W_dec)
                weight = config.aux_coef * min(dead_count / k_aux, 1.0)
                loss = loss + weight * _normalised_mse(aux_reconstruction, residual).nan_to_num(0.0)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                grad = W_dec.grad
                grad -= (grad * W_dec).sum(1, keepdim=True) * W_dec  # keep the rows on the unit sphere
                for group in optimizer.param_groups:
                    group["lr"] = lr * min(1.0, (steps - step) / max(1.0, steps - decay_from))
                optimizer.step()
                W_dec /= W_dec.norm(dim=1, keepdim=True)
                silent += config.batch
                silent[top[latents.detach() > 0]] = 0
            epoch_error += error.item()
            epoch_variance += variance.item()
            step += 1
            bar.update()
            if step % 5 == 0 or step == steps:
                bar.set_postfix(
                    loss=f"{loss.item():.4f}",
                    fve=f"{1 - epoch_error / epoch_variance:.3f}",
                    dead=f"{(silent >= config.dead_tokens).float().mean().item():.1%}",
                )
    bar.close()
    with torch.no_grad():  # fold the input scale back: the same latents, divided by `scale`
        sae = TopKSAE(
            W_enc.detach().T.contiguous(),
            b_enc.detach() / scale,
            W_dec.detach().clone(),
            b_dec.detach() / scale,
            config.k,
        )
    return TrainResult(
        sae=sae,
        scale=scale,
        steps=steps,
        tokens=steps * config.batch,
        seconds=time.monotonic() - started,
        alive=silent < config.dead_tokens,
        train_fve=1 - epoch_error / max(epoch_variance, 1e-12),
    )
