"""A random SAE for the tiny model (hidden 128), saved in SAELens's format: its encoder reads
along its unit decoder rows, so features fire where the residual points their way."""

from __future__ import annotations

from pathlib import Path

import torch

from salience.core.features.sae import save_sae


def random_sae(folder: Path, architecture: str, layer: int, d_sae: int, seed: int, **extra) -> Path:
    generator = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(d_sae, 128, generator=generator)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    save_sae(
        folder,
        architecture=architecture,
        layer=layer,
        W_enc=w_dec.T.contiguous() * 0.5,
        b_enc=torch.randn(d_sae, generator=generator) * 0.1,
        W_dec=w_dec,
        b_dec=torch.randn(128, generator=generator) * 0.05,
        model_name="tiny",
        **extra,
    )
    return folder
