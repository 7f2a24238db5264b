"""Model folders: whether one can be served, and the facts other layers read from it.

vLLM reports a bad folder with a deep traceback from inside its engine process;
checking up front lets the CLI end with one line naming the problem. Concept sets
record the shape and fingerprint of the model they were built for (probes/concepts.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from salience.core.models.families import Family, family_of
from salience.errors import ModelError

if TYPE_CHECKING:
    import torch

__all__ = ["ModelFolder", "inspect_model_folder", "model_family", "model_fingerprint", "model_shape", "text_config"]


@dataclass(frozen=True, kw_only=True)
class ModelFolder:
    path: Path
    architectures: tuple[str, ...]
    config: dict


def inspect_model_folder(path: str | Path) -> ModelFolder:
    """Read config.json and check vLLM knows the architecture."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelError(f"model folder {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ModelError(f"model path {str(folder)!r} is not a folder")
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{str(folder)!r} has no config.json: not a Hugging Face model folder") from None
    except PermissionError:
        raise ModelError(f"cannot read {str(config_path)!r}: permission denied") from None
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {str(config_path)!r}: {exc}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{str(config_path)!r} does not hold a JSON object")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise ModelError(f"{str(config_path)!r} names no architectures")
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    if not any(arch in supported for arch in architectures):
        raise ModelError(f"architecture {', '.join(map(str, architectures))} is not supported by vLLM")
    return ModelFolder(path=folder.resolve(), architectures=tuple(architectures), config=config)


def model_family(model_dir: Path) -> Family:
    """The family config.json's architectures name (ModelError if Salience reads none of them)."""
    config = json.loads((model_dir / "config.json").read_text())
    return family_of(config.get("architectures") or [])


def text_config(model_dir: Path) -> dict:
    """config.json's language-model part: a vision-language model nests it under `text_config`."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config") or config


def model_shape(model_dir: Path) -> tuple[int, int]:
    """(hidden size, number of decoder layers) of the language model, under the family's names."""
    family, config = model_family(model_dir), text_config(model_dir)
    return int(config[family.hidden_key]), int(config[family.layers_key])


def model_fingerprint(model_dir: Path) -> str:
    """Identifies the weights cheaply: shape settings plus the first rows of the input embedding,
    whatever the family names it (a folder without one is refused: its shape alone would let a
    set built for other weights of that shape through)."""
    import torch  # only here: the rest of this module serves the CLI before torch is needed
    from safetensors import safe_open

    family = model_family(model_dir)
    digest = hashlib.sha256(json.dumps(model_shape(model_dir)).encode())
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            name = next((k for k in handle.keys() if _named(k, family.embedding)), None)  # noqa: SIM118
            if name is not None:
                digest.update(handle.get_slice(name)[:4].to(torch.float32).numpy().tobytes())
                return digest.hexdigest()
    raise ModelError(f"{model_dir}: no input embedding ({family.embedding}) in its safetensors files")


def _named(tensor: str, suffix: str) -> bool:
    """Whether checkpoint tensor `tensor` is the one named `suffix` (a whole dotted part, so
    `wte.weight` is not `xwte.weight`)."""
    return tensor == suffix or tensor.endswith("." + suffix)


def unembedding(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The final norm's weight [hidden] and the unembedding [vocab, hidden] (the input embedding
    where the model ties them), float32: what a logit lens of a residual-stream vector goes
    through (Family.norm_scale says how the norm's weight applies)."""
    from safetensors import safe_open

    family = model_family(model_dir)
    norm = f"{family.final_norm}.weight"
    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if any(_named(name, head) for head in family.unembedding):
                    found["head"] = handle.get_tensor(name)
                elif _named(name, family.embedding):
                    found["embed"] = handle.get_tensor(name)
                elif _named(name, norm) and f".{family.layers}." not in name and "visual" not in name:
                    found["norm"] = handle.get_tensor(name)
    if "norm" not in found or not ({"head", "embed"} & set(found)):
        raise ModelError(f"{model_dir}: no final norm or unembedding weights found")
    return found["norm"].float(), found.get("head", found.get("embed")).float()
