"""The reference for SAEs: SAELens's loading and encode/decode math, restated in numpy float64.

Written from SAELens 6's source, independent of salience's code:

- loading/pretrained_sae_loaders.py: a cfg.json whose `sae_lens_version` (top level or in
  `metadata`) is missing or below 6 goes through handle_pre_6_0_config: `hook_point` is renamed
  `hook_name`, `activation_fn_str` is renamed `activation_fn`, `apply_b_dec_to_input` defaults to
  True, `architecture` to "standard", and activation_fn "topk" with `activation_fn_kwargs.k` makes
  a topk SAE with that k; a bool normalize_activations means "expected_average_only_in" if true.
  read_sae_components_from_disk drops a `scaling_factor` tensor of ones.
- saes/sae.py process_sae_in: sae_in = x - b_dec * apply_b_dec_to_input (normalisation "none").
- saes/standard_sae.py: relu(sae_in @ W_enc + b_enc).
- saes/jumprelu_sae.py: relu(pre) * (pre > threshold).
- saes/topk_sae.py: pre, times ||W_dec row|| if rescale_acts_by_decoder_norm; torch.topk's k
  values through relu, scattered into zeros; decode divides acts by ||W_dec row|| first if
  rescaling. Ties are broken here towards the lowest feature ids (a stable sort), which SAELens
  leaves unspecified; tests that compare ids avoid ties.
- decode: acts @ W_dec + b_dec.
- saes/transcoder.py: a transcoder's process_sae_in never subtracts b_dec (it is d_out wide, the
  output hook's); "transcoder" and "skip_transcoder" encode as standard, "jumprelu_transcoder" as
  jumprelu; a skip transcoder's output adds x @ W_skip.T to the decode.

`write_folder` writes a folder as another tool would, for the tests to craft any cfg.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch


def sae_lens_version(cfg: dict[str, Any]) -> int:
    """The major version SAELens reads the layout by (0 when missing)."""
    version = cfg.get("sae_lens_version") or (cfg.get("metadata") or {}).get("sae_lens_version")
    match = re.match(r"\d+", version or "")
    return int(match.group()) if match else 0


def to_v6(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg.json as SAELens 6 sees it (only the fields the math and the hook depend on)."""
    if sae_lens_version(cfg) >= 6:
        out = dict(cfg)
        out.setdefault("apply_b_dec_to_input", True)
        out["hook_name"] = cfg["metadata"]["hook_name"]
        return out
    renames = {
        "hook_point": "hook_name",
        "hook_point_head_index": "hook_head_index",
        "activation_fn_str": "activation_fn",
    }
    out = {renames.get(key, key): value for key, value in cfg.items()}
    out.setdefault("apply_b_dec_to_input", True)
    out.setdefault("architecture", "standard")
    if out.get("activation_fn") == "topk" and (out.get("activation_fn_kwargs") or {}).get("k") is not None:
        out["architecture"] = "topk"
        out["k"] = out["activation_fn_kwargs"]["k"]
    if isinstance(out.get("normalize_activations"), bool):
        out["normalize_activations"] = "expected_average_only_in" if out["normalize_activations"] else "none"
    return out


def read_folder(folder: Path) -> dict[str, Any]:
    """cfg (as SAELens 6 sees it) and the weights in float64."""
    cfg = to_v6(json.loads((Path(folder) / "cfg.json").read_text()))
    tensors = safetensors.torch.load_file(str(Path(folder) / "sae_weights.safetensors"))
    if "scaling_factor" in tensors and bool((tensors["scaling_factor"] == 1).all()):
        del tensors["scaling_factor"]
    weights = {key: value.double().numpy() for key, value in tensors.items()}
    return {"cfg": cfg, **weights}


def _rescales(ref: dict[str, Any]) -> bool:
    return ref["cfg"]["architecture"] == "topk" and bool(ref["cfg"].get("rescale_acts_by_decoder_norm", False))


TRANSCODERS = {"transcoder": "standard", "skip_transcoder": "standard", "jumprelu_transcoder": "jumprelu"}


def pre_activations(ref: dict[str, Any], x: np.ndarray) -> np.ndarray:
    sae_in = np.asarray(x, np.float64)
    if ref["cfg"]["apply_b_dec_to_input"] and ref["cfg"]["architecture"] not in TRANSCODERS:
        sae_in = sae_in - ref["b_dec"]
    return sae_in @ ref["W_enc"] + ref["b_enc"]


def encode(ref: dict[str, Any], x: np.ndarray) -> np.ndarray:
    pre = pre_activations(ref, x)
    arch = TRANSCODERS.get(ref["cfg"]["architecture"], ref["cfg"]["architecture"])
    if arch == "standard":
        return np.maximum(pre, 0.0)
    if arch == "jumprelu":
        return np.maximum(pre, 0.0) * (pre > ref["threshold"])
    assert arch == "topk", arch
    if _rescales(ref):
        pre = pre * np.linalg.norm(ref["W_dec"], axis=-1)
    ids = np.argsort(-pre, axis=-1, kind="stable")[..., : ref["cfg"]["k"]]
    out = np.zeros_like(pre)
    np.put_along_axis(out, ids, np.maximum(np.take_along_axis(pre, ids, axis=-1), 0.0), axis=-1)
    return out


def decode(ref: dict[str, Any], acts: np.ndarray) -> np.ndarray:
    acts = np.asarray(acts, np.float64)
    if _rescales(ref):
        acts = acts / np.linalg.norm(ref["W_dec"], axis=-1)
    return acts @ ref["W_dec"] + ref["b_dec"]


def transcode(ref: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """A transcoder's output for input x: decode(encode(x)), plus x @ W_skip.T for a skip transcoder."""
    out = decode(ref, encode(ref, x))
    return out + np.asarray(x, np.float64) @ ref["W_skip"].T if "W_skip" in ref else out


def write_folder(folder: Path, cfg: dict[str, Any] | str | None, tensors: dict[str, Any] | bytes | None) -> Path:
    """A folder with this cfg.json (a dict, raw text, or None for none) and these weights (tensors
    or arrays, raw bytes, or None for no file)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (folder / "cfg.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    if isinstance(tensors, bytes):
        (folder / "sae_weights.safetensors").write_bytes(tensors)
    elif tensors is not None:
        as_torch = {key: torch.as_tensor(value).contiguous() for key, value in tensors.items()}
        safetensors.torch.save_file(as_torch, str(folder / "sae_weights.safetensors"))
    return folder
