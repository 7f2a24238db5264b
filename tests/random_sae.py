"""A random SAE for the tiny model (hidden 128), saved in SAELens's format: its encoder reads
along its unit decoder rows, so features fire where the residual points their way."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from salience.core.features.sae import save_sae
from salience.core.models.atomic import build_folder_once
from salience.core.models.home import salience_home
from salience.core.models.points import Point


def random_sae(
    folder: Path, architecture: str, layer: int, d_sae: int, seed: int, point: Point = "resid_post", **extra
) -> Path:
    generator = torch.Generator().manual_seed(seed)
    w_dec = torch.randn(d_sae, 128, generator=generator)
    w_dec = w_dec / w_dec.norm(dim=1, keepdim=True)
    save_sae(
        folder,
        architecture=architecture,
        layer=layer,
        point=point,
        W_enc=w_dec.T.contiguous() * 0.5,
        b_enc=torch.randn(d_sae, generator=generator) * 0.1,
        W_dec=w_dec,
        b_dec=torch.randn(128, generator=generator) * 0.05,
        model_name="tiny",
        **extra,
    )
    return folder


def stored(folder: Path) -> Path:
    """A content-addressed copy of an SAE folder under SALIENCE_HOME: the same SAE sits at the same
    path on every run. vLLM keys its compile cache by the tap config, which names each SAE's path,
    so a compiled engine serving SAEs from a fresh temporary folder traced again on every run; from
    here it loads the AOT artifact an earlier run saved."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    target = salience_home() / "test-saes" / digest.hexdigest()[:24]
    return build_folder_once(target, lambda out: shutil.copytree(folder, out, dirs_exist_ok=True))
