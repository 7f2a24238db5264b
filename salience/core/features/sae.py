"""Sparse autoencoders (SAEs) over the residual stream, in SAELens's folder format.

Theory of operation. A SAELens folder holds `cfg.json` and `sae_weights.safetensors`: W_enc
[d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_in], b_dec [d_in], and for jumprelu threshold
[d_sae]. With x' = x - b_dec if apply_b_dec_to_input else x, and pre = x' @ W_enc + b_enc,
SAELens encodes (sae_lens/saes/*_sae.py)

    standard   relu(pre)
    jumprelu   relu(pre) * (pre > threshold)
    topk       the k largest entries of pre, each through relu; every other entry 0

and decodes acts @ W_dec + b_dec. cfg.json has two layouts: SAELens >= 6 (`architecture`, `k`,
`metadata.hook_name`) and the older flat one (`hook_name` or `hook_point` at the top level, topk
spelled `activation_fn_str: "topk"` with `activation_fn_kwargs: {"k": ...}`). Like SAELens, a
`sae_lens_version` (top level or in metadata) below 6, or none, means the old layout.

Refused, because this module would not reproduce the math (or SAELens would silently change
it): input normalisation other than "none" (layer_norm and constant_norm_rescale transform each
token's input and undo it after decoding; expected_average_only_in scales inputs by a
dataset-wide factor the folder does not carry, which SAELens's load_from_disk ignores), hook_z
reshaping, an attention head index, an old activation function other than relu and topk (SAELens
6 turns tanh-relu into relu), topk without k (SAELens 6 makes an old one standard, a new one
k=100), a finetuning scaling_factor other than 1, and a hook that is no point of a layer
(models/points.py reads the hook names; the model's family says whether it has the point).
A topk SAE with rescale_acts_by_decoder_norm is accepted: its decoder norms are
folded into W_enc, b_enc and W_dec at load, as SAELens does when it saves an inference SAE,
which leaves encode and decode as they were.

Numbers are float32 whatever the file holds (SAELens computes in cfg.json's dtype). TopK ties:
SAELens leaves them to torch.topk, which promises nothing; here, when the k-th largest
pre-activation is tied, the lowest feature ids among the tied are kept, so results are
reproducible.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from salience.core.models.points import Point, Site, parse_hook
from salience.errors import ModelError

if TYPE_CHECKING:
    from salience.core.models.families import Family

__all__ = ["ARCHITECTURES", "SparseAutoencoder", "check_fits", "load_sae", "save_sae"]

ARCHITECTURES = ("standard", "topk", "jumprelu")
# SAELens's transcoders, by the encoder math each uses: they read one hook (the MLP's input) and
# reconstruct another (its output, cfg.json's hook_name_out, d_out wide); b_dec is the output's,
# so SAELens never subtracts it from the input. A skip transcoder adds W_skip @ x to its output.
TRANSCODERS = {"transcoder": "standard", "skip_transcoder": "standard", "jumprelu_transcoder": "jumprelu"}
CFG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
_FOLDER_FILES = {CFG_FILE, WEIGHTS_FILE, "sparsity.safetensors"}  # what save_sae may overwrite
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPES = {"float16", "bfloat16", "float32", "float64"}
_NORMALISATIONS = {
    "layer_norm": "each token's input is standardised to mean 0 and std 1",
    "constant_norm_rescale": "each token's input is rescaled to norm sqrt(d_in)",
    "expected_average_only_in": "inputs are scaled by a dataset-wide factor the folder does not carry",
}
_INFO_KEYS = (
    "name",
    "layer",
    "point",
    "d_in",
    "d_sae",
    "architecture",
    "k",
    "hook_name",
    "apply_b_dec_to_input",
    "sha256",
)
_TRANSCODER_KEYS = ("transcoder", "hook_name_out", "d_out")


@dataclass(frozen=True, eq=False)
class SparseAutoencoder:
    """One SAE, read from its folder and checked; see the module docstring for the math."""

    name: str
    folder: Path
    architecture: str
    layer: int
    point: Point  # the hook point of `layer` it reads (models/points.py)
    hook_name: str
    d_in: int
    d_sae: int
    k: int | None
    apply_b_dec_to_input: bool
    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    threshold: torch.Tensor | None
    sha256: str
    # A transcoder's: its kind (TRANSCODERS), the hook and width it reconstructs, its skip matrix.
    transcoder: str | None = None
    hook_name_out: str | None = None
    d_out: int | None = None
    W_skip: torch.Tensor | None = None

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_in] -> [..., d_sae], before the architecture's nonlinearity."""
        x = x.to(self.W_enc.dtype)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations [..., d_sae], as SAELens computes them (ties: module docstring)."""
        pre = self.pre_activations(x)
        if self.architecture == "standard":
            return pre.relu()
        if self.architecture == "jumprelu":
            return pre.relu() * (pre > self.threshold)
        kth = torch.topk(pre, self.k, dim=-1).values[..., -1:]
        tied = pre == kth
        room = self.k - (pre > kth).sum(dim=-1, keepdim=True)
        keep = (pre > kth) | (tied & (tied.cumsum(dim=-1) <= room))
        return torch.where(keep, pre.relu(), 0.0)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """[..., d_sae] -> [..., d_in]: the reconstruction of the residual (a transcoder's:
        [..., d_out] of its output hook, without a skip transcoder's W_skip @ x)."""
        return acts.to(self.W_dec.dtype) @ self.W_dec + self.b_dec

    @property
    def site(self) -> Site:
        return Site(self.layer, self.point)

    def to(self, device: torch.device | str) -> SparseAutoencoder:
        """A copy whose tensors live on `device`."""
        moved = {f: getattr(self, f).to(device) for f in ("W_enc", "b_enc", "W_dec", "b_dec")}
        optional = {
            f: None if getattr(self, f) is None else getattr(self, f).to(device) for f in ("threshold", "W_skip")
        }
        return dataclasses.replace(self, **optional, **moved)

    def info(self) -> dict[str, Any]:
        """What clients are told about the SAE (JSON-able): a transcoder's kind and output too."""
        keys = _INFO_KEYS + (_TRANSCODER_KEYS if self.transcoder else ())
        return {key: getattr(self, key) for key in keys}


def check_fits(sae: SparseAutoencoder, *, hidden_size: int, num_layers: int, family: Family | None = None) -> None:
    """ModelError unless the SAE reads a residual this model has (at a point its `family` has)."""
    if sae.d_in != hidden_size:
        raise ModelError(f"SAE {sae.name} reads d_in {sae.d_in} but the model's hidden size is {hidden_size}")
    if not 0 <= sae.layer < num_layers:
        raise ModelError(f"SAE {sae.name} reads layer {sae.layer} but the model has layers 0..{num_layers - 1}")
    if family is not None:
        family.locate(sae.point, reader=f"SAE {sae.name} reads {sae.hook_name}")


def load_sae(folder: Path, *, name: str | None = None) -> SparseAutoencoder:
    """Read and check a SAELens folder; ModelError naming the folder and the problem."""
    folder = Path(folder).absolute()
    if not folder.is_dir():
        raise ModelError(f"SAE folder {folder} does not exist")
    for file_name in (CFG_FILE, WEIGHTS_FILE):
        if not (folder / file_name).is_file():
            raise ModelError(f"SAE folder {folder} has no {file_name}")
    try:
        cfg_bytes, weight_bytes = (folder / CFG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    except OSError as e:
        raise ModelError(f"SAE folder {folder}: cannot read {e.filename} ({e.strerror})") from None
    try:
        return _build(folder, name or folder.name, cfg_bytes, weight_bytes)
    except ValueError as e:
        raise ModelError(f"SAE folder {folder}: {e}") from None


def _build(folder: Path, name: str, cfg_bytes: bytes, weight_bytes: bytes) -> SparseAutoencoder:
    try:
        cfg = json.loads(cfg_bytes)
    except ValueError as e:
        raise ValueError(f"{CFG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{CFG_FILE} is not a JSON object")
    fields, rescale = _read_cfg(cfg)
    w = _read_weights(weight_bytes, fields)
    if rescale:  # SAELens scales pre by ||W_dec row|| and divides acts by it in decode: fold both
        norms = w["W_dec"].norm(dim=-1)
        if not bool((norms > 0).all()):
            raise ValueError("rescale_acts_by_decoder_norm with a zero W_dec row divides by zero")
        w["W_enc"], w["b_enc"] = (w["W_enc"] * norms).contiguous(), w["b_enc"] * norms
        w["W_dec"] = (w["W_dec"] / norms[:, None]).contiguous()
    digest = hashlib.sha256(hashlib.sha256(cfg_bytes).digest() + hashlib.sha256(weight_bytes).digest())
    return SparseAutoencoder(name=name, folder=folder, **fields, **w, sha256=digest.hexdigest())


def _typed(value: Any, key: str, kind: type) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{CFG_FILE} needs {key!r} as {kind.__name__}, got {value!r}")
    return value


def _read_cfg(cfg: dict) -> tuple[dict[str, Any], bool]:
    """SparseAutoencoder's fields from either layout, and whether a topk rescales by decoder norms;
    refusing what would change the math unseen."""
    meta = cfg.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{CFG_FILE} 'metadata' is not an object")
    version = cfg.get("sae_lens_version") or meta.get("sae_lens_version")
    legacy = not (isinstance(version, str) and (m := re.match(r"\d+", version)) and int(m.group()) >= 6)
    if "d_in" not in cfg or "d_sae" not in cfg:
        raise ValueError(f"{CFG_FILE} has no {'d_in' if 'd_in' not in cfg else 'd_sae'!r}")
    d_in, d_sae = _typed(cfg["d_in"], "d_in", int), _typed(cfg["d_sae"], "d_sae", int)
    if d_in < 1 or d_sae < 1:
        raise ValueError(f"{CFG_FILE} has d_in {d_in} and d_sae {d_sae}; both must be positive")
    if not legacy and "architecture" not in cfg:
        raise ValueError(f"{CFG_FILE} has no 'architecture'")
    architecture, k = cfg.get("architecture", "standard"), cfg.get("k")
    transcoder = architecture if architecture in TRANSCODERS else None
    architecture = TRANSCODERS.get(architecture, architecture)
    act = cfg.get("activation_fn_str", cfg.get("activation_fn")) or "relu"
    if act not in ("relu", "topk"):
        raise ValueError(f"activation function {act!r} is not supported (relu, or topk with a k)")
    if act == "topk" and legacy:
        kwargs = cfg.get("activation_fn_kwargs") or {}
        architecture, k = "topk", kwargs.get("k") if isinstance(kwargs, dict) else None
    elif act == "topk" and architecture != "topk":
        raise ValueError(f"activation function 'topk' contradicts architecture {architecture!r}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if architecture != "topk":
        k = None
    elif isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_sae:
        raise ValueError(f"a topk SAE needs an integer k with 1 <= k <= d_sae ({d_sae}), got {k!r}")
    rescale = architecture == "topk" and _typed(
        cfg.get("rescale_acts_by_decoder_norm", False), "rescale_acts_by_decoder_norm", bool
    )
    norm = cfg.get("normalize_activations")
    if isinstance(norm, bool):  # old layouts: a flag meaning expected_average_only_in
        norm = "expected_average_only_in" if norm else None
    if norm not in (None, "none"):
        why = _NORMALISATIONS.get(norm, "an unknown transformation")
        raise ValueError(
            f"normalize_activations {norm!r} is not supported: it changes the input per token "
            f"before encoding ({why}), which is not implemented"
        )
    if cfg.get("reshape_activations") not in (None, "none"):
        raise ValueError(f"reshape_activations {cfg['reshape_activations']!r} (attention hook_z) is not supported")
    head = meta.get("hook_head_index", cfg.get("hook_head_index", cfg.get("hook_point_head_index")))
    if head is not None:
        raise ValueError(f"hook_head_index {head!r}: an SAE on one attention head is not supported")
    dtype = cfg.get("dtype")
    if dtype is not None and (not isinstance(dtype, str) or dtype.removeprefix("torch.") not in _DTYPES):
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}")
    hook = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point")
    if not isinstance(hook, str):
        raise ValueError(f"{CFG_FILE} names no hook (metadata.hook_name, or hook_name in older layouts)")
    apply_b_dec = _typed(cfg.get("apply_b_dec_to_input", True), "apply_b_dec_to_input", bool)
    site = parse_hook(hook)
    fields = {"architecture": architecture, "layer": site.layer, "point": site.point, "hook_name": hook, "d_in": d_in}
    fields |= {"d_sae": d_sae, "k": k, "apply_b_dec_to_input": apply_b_dec and transcoder is None}
    if transcoder is not None:
        out = meta.get("hook_name_out") or cfg.get("hook_name_out")
        if not isinstance(out, str):
            raise ValueError(f"a {transcoder} names the hook it reconstructs: {CFG_FILE} has no hook_name_out")
        d_out = _typed(cfg.get("d_out", d_in), "d_out", int)
        if d_out < 1:
            raise ValueError(f"{CFG_FILE} has d_out {d_out}; it must be positive")
        fields |= {"transcoder": transcoder, "hook_name_out": out, "d_out": d_out}
    return fields, rescale


def _read_weights(blob: bytes, fields: dict[str, Any]) -> dict[str, Any]:
    """The tensors `fields` (from _read_cfg) call for, checked and in float32."""
    architecture, d_in, d_sae = fields["architecture"], fields["d_in"], fields["d_sae"]
    d_out = fields.get("d_out") or d_in
    try:
        raw = safetensors.torch.load(blob)
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ValueError(f"cannot read {WEIGHTS_FILE} ({e})") from None
    scaling = raw.pop("scaling_factor", None)  # SAELens drops it when all ones, and cannot apply it otherwise
    if scaling is not None and not bool((scaling == 1).all()):
        raise ValueError("a finetuning scaling_factor other than 1 (it rescales activations) is not supported")
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,)}
    if architecture == "jumprelu":
        shapes["threshold"] = (d_sae,)
    if fields.get("transcoder") == "skip_transcoder":
        shapes["W_skip"] = (d_out, d_in)
    architecture = fields.get("transcoder") or architecture
    if missing := sorted(shapes.keys() - raw.keys()):
        hint = "; log_threshold is a training checkpoint's, SAELens saves threshold" if "log_threshold" in raw else ""
        raise ValueError(f"a {architecture} SAE needs {', '.join(missing)}, missing from {WEIGHTS_FILE}{hint}")
    if extra := sorted(raw.keys() - shapes.keys()):
        raise ValueError(f"unexpected tensors {', '.join(extra)} in {WEIGHTS_FILE} for a {architecture} SAE")
    out: dict[str, Any] = {"threshold": None}
    for key, shape in shapes.items():
        t = raw[key]
        if tuple(t.shape) != shape:
            sizes = f"d_in {d_in}, d_sae {d_sae}" + (f", d_out {d_out}" if "d_out" in fields else "")
            raise ValueError(f"{key} has shape {list(t.shape)}, expected {list(shape)} ({sizes})")
        if t.dtype not in _FLOATS:
            raise ValueError(f"{key} is {t.dtype}, not a float tensor")
        out[key] = t.to(torch.float32).contiguous()
        if not bool(torch.isfinite(out[key]).all()):
            raise ValueError(f"{key} has non-finite values")
    return out


def save_sae(
    folder: Path,
    *,
    architecture: str,
    layer: int,
    point: Point = "resid_post",
    W_enc,
    b_enc,
    W_dec,
    b_dec,
    k: int | None = None,
    threshold=None,
    model_name: str = "",
    extra_metadata: dict | None = None,
    apply_b_dec_to_input: bool = True,
) -> None:
    """Write a folder SAELens 6 loads (and load_sae accepts), atomically: a scratch folder beside
    the target is renamed into place, so an interrupted save leaves the old folder or nothing.
    An existing folder is replaced only if it holds nothing but SAELens's files."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not one of {', '.join(ARCHITECTURES)}")
    if (k is not None) != (architecture == "topk") or (threshold is not None) != (architecture == "jumprelu"):
        raise ValueError("k is given for topk SAEs only and threshold for jumprelu ones only, and they need them")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    given = {"W_enc": W_enc, "b_enc": b_enc, "W_dec": W_dec, "b_dec": b_dec, "threshold": threshold}
    tensors = {
        key: torch.as_tensor(value).detach().to("cpu", torch.float32).contiguous()
        for key, value in given.items()
        if value is not None
    }
    if tensors["W_enc"].ndim != 2:
        raise ValueError(f"W_enc must be [d_in, d_sae], got shape {list(tensors['W_enc'].shape)}")
    d_in, d_sae = tensors["W_enc"].shape
    # SAELens tells the layouts apart by sae_lens_version; without it, it drops this metadata.
    metadata = {"sae_lens_version": "6.0.0", "model_name": model_name, "hook_name": str(Site(layer, point))}
    metadata |= {"hook_head_index": None, "prepend_bos": True}
    if clash := {"sae_lens_version", "hook_name", "hook_head_index"} & (extra_metadata or {}).keys():
        raise ValueError(f"extra_metadata may not set {', '.join(sorted(clash))}")
    metadata.update(extra_metadata or {})
    cfg: dict[str, Any] = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32"}
    cfg |= {"device": "cpu", "apply_b_dec_to_input": apply_b_dec_to_input, "normalize_activations": "none"}
    cfg["reshape_activations"] = "none"
    if architecture == "topk":
        cfg |= {"k": k, "rescale_acts_by_decoder_norm": False}
    cfg["metadata"] = metadata
    files = {CFG_FILE: json.dumps(cfg, indent=2).encode(), WEIGHTS_FILE: safetensors.torch.save(tensors)}
    _build(Path(folder), "", files[CFG_FILE], files[WEIGHTS_FILE])  # refuse to write what load_sae refuses
    _write_folder(Path(folder).absolute(), files)


def _write_folder(folder: Path, files: dict[str, bytes]) -> None:
    if folder.exists() and not (folder.is_dir() and {p.name for p in folder.iterdir()} <= _FOLDER_FILES):
        raise FileExistsError(f"{folder} exists and is not an SAE folder; not replacing it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp", dir=folder.parent))
    try:
        for file_name, data in files.items():
            with open(scratch / file_name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        scratch.chmod(0o755)
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex}"
        if folder.exists():
            folder.rename(old)
        try:
            scratch.rename(folder)
        except OSError:
            if old.exists():
                old.rename(folder)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
