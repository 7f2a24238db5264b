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


def random_transcoder(folder: Path, layer: int, d_sae: int, seed: int) -> Path:
    """A random SAELens transcoder of the tiny model's layer `layer`: it reads the MLP's input
    (`blocks.L.ln2.hook_normalized`) along unit rows, as random_sae does, and reconstructs its
    output; written as SAELens 6 saves one (cfg.json and weights, no save_sae: that writes SAEs)."""
    from tests.sae_reference import write_folder

    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(d_sae, 128, generator=generator)
    rows = rows / rows.norm(dim=1, keepdim=True)
    cfg = {"architecture": "transcoder", "d_in": 128, "d_sae": d_sae, "d_out": 128, "dtype": "float32"}
    cfg |= {"device": "cpu", "apply_b_dec_to_input": False, "normalize_activations": "none"}
    cfg["metadata"] = {
        "sae_lens_version": "6.12.0",
        "hook_name": f"blocks.{layer}.ln2.hook_normalized",
        "hook_name_out": f"blocks.{layer}.hook_mlp_out",
    }
    weights = {
        "W_enc": rows.T.contiguous() * 0.5,
        "b_enc": torch.randn(d_sae, generator=generator) * 0.1,
        "W_dec": torch.randn(d_sae, 128, generator=generator) * 0.1,
        "b_dec": torch.randn(128, generator=generator) * 0.05,
    }
    return write_folder(folder, cfg, weights)


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
