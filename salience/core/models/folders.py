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

from salience.errors import ModelError

if TYPE_CHECKING:
    import torch

__all__ = ["ModelFolder", "inspect_model_folder", "model_fingerprint", "model_shape", "text_config"]


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


def text_config(model_dir: Path) -> dict:
    """config.json's language-model part: a vision-language model nests it under `text_config`."""
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config") or config


def model_shape(model_dir: Path) -> tuple[int, int]:
    """(hidden_size, num_hidden_layers) of the language model."""
    config = text_config(model_dir)
    return int(config["hidden_size"]), int(config["num_hidden_layers"])


def model_fingerprint(model_dir: Path) -> str:
    """Identifies the weights cheaply: shape settings plus the first embedding rows."""
    import torch  # only here: the rest of this module serves the CLI before torch is needed
    from safetensors import safe_open

    digest = hashlib.sha256(json.dumps(model_shape(model_dir)).encode())
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            name = next((k for k in handle.keys() if k.endswith("embed_tokens.weight")), None)  # noqa: SIM118
            if name is not None:
                digest.update(handle.get_slice(name)[:4].to(torch.float32).numpy().tobytes())
                break
    return digest.hexdigest()


def unembedding(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The final norm's weight [hidden] and the unembedding [vocab, hidden] (the input embedding
    where the model ties them), float32: what a logit lens of a residual-stream vector goes through."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if name.endswith("lm_head.weight"):
                    found["lm_head"] = handle.get_tensor(name)
                elif name.endswith("embed_tokens.weight"):
                    found["embed"] = handle.get_tensor(name)
                elif name.endswith("norm.weight") and ".layers." not in name and "visual" not in name:
                    found["norm"] = handle.get_tensor(name)
    if "norm" not in found or not ({"lm_head", "embed"} & set(found)):
        raise ModelError(f"{model_dir}: no final norm or unembedding weights found")
    return found["norm"].float(), found.get("lm_head", found.get("embed")).float()
