"""Checks that a model folder can be served, before the engine is started.

vLLM reports a bad folder with a deep traceback from inside its engine process;
checking up front lets the CLI end with one line naming the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from salience.errors import ModelError

__all__ = ["ModelFolder", "inspect_model_folder"]


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
