"""Concept readouts inside the model's forward, compiled or eager.

Theory of operation. vLLM compiles the decoder stack (torch.compile; CUDA graphs
on GPU) when the engine starts, before any RPC could reach the worker, and
forward hooks do not fire in a compiled graph. So the readout must be part of
the model the compiler sees:

- `SalienceLoader`, registered as vLLM load format `salience_readouts`, loads
  the weights as vLLM's default loader does and then wraps each readout layer
  in a `ReadoutTap`. vLLM resolves the worker extension (readout_worker.py,
  which imports this module) before it loads the model, so the registration
  is in place in every worker process.
- A `ReadoutTap` runs its decoder layer, then projects `hidden + residual`
  (the layer's output before the final norm, in vLLM's fused add-norm layers)
  onto the layer's `[hidden, concepts]` matrix in float32 and writes the
  `[tokens, concepts]` result into slot i of one persistent, statically
  addressed buffer `[max_tokens, layers, concepts]` through the op
  `salience::readout_store`, which declares the buffer as mutated (as vLLM's
  attention ops declare their output buffer). The projection is ordinary
  tensor code, traced and fused with the layer; only the small float32 block
  leaves the graph, never a hidden state.
- After each step the worker copies the rows requests asked for out of the
  buffer (readout_worker.py); rows past the step's real tokens (padding to a
  compiled or captured batch size) are never read.

The concept vectors are loaded here, before compilation, from a content-
addressed file named in vLLM's `additional_config`. vLLM folds
`additional_config` into the hash that keys its compile cache, so a graph
built for one concept set is never reused for another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "CONFIG_KEY",
    "LOAD_FORMAT",
    "ReadoutTap",
    "decoder_stack",
    "file_digest",
    "readout_buffer",
]

log = logging.getLogger(__name__)

LOAD_FORMAT = "salience_readouts"
CONFIG_KEY = "salience_readouts"  # in vLLM's additional_config: {"path", "sha256", "layers"}


@torch.library.custom_op("salience::readout_store", mutates_args=("buffer",))
def readout_store(values: torch.Tensor, buffer: torch.Tensor, slot: int) -> None:
    """buffer[:rows, slot] = values: the graph's one write, into a buffer at a fixed address."""
    buffer[: values.shape[0], slot].copy_(values)


@readout_store.register_fake
def _(values: torch.Tensor, buffer: torch.Tensor, slot: int) -> None:
    return None


class ReadoutTap(nn.Module):
    """A decoder layer followed by its concept projection."""

    def __init__(self, layer: nn.Module, slot: int, matrix: torch.Tensor, buffer: torch.Tensor) -> None:
        super().__init__()
        self.layer = layer
        self.slot = slot
        self.register_buffer("matrix", matrix, persistent=False)  # [hidden, concepts] float32
        self.register_buffer("out", buffer, persistent=False)  # shared by every tap

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.layer(*args, **kwargs)
        if isinstance(output, tuple):
            hidden, residual = output[0], output[1] if len(output) > 1 else None
        else:
            hidden, residual = output, None
        state = hidden.float() if residual is None else hidden.float() + residual.float()
        torch.ops.salience.readout_store(state @ self.matrix, self.out, self.slot)
        return output


def decoder_stack(model: nn.Module) -> tuple[range, nn.ModuleList]:
    """The decoder layers of the text models Salience serves (Qwen2, Llama, Qwen2-VL's
    language model), and which of them this pipeline stage holds."""
    for path in ("model", "language_model.model", "model.language_model"):
        owner: Any = model
        try:
            for part in path.split("."):
                owner = getattr(owner, part)
            layers = owner.layers
        except AttributeError:
            continue
        return range(getattr(owner, "start_layer", 0), getattr(owner, "end_layer", len(layers))), layers
    raise AttributeError(f"no decoder layers found in {type(model).__name__}")


def readout_buffer(model: nn.Module) -> torch.Tensor | None:
    """The buffer the taps write, or None if the model has no taps."""
    for layer in decoder_stack(model)[1]:
        if isinstance(layer, ReadoutTap):
            return layer.out
    return None


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _install_taps(model: nn.Module, spec: dict, max_tokens: int, device: torch.device) -> None:
    from salience.core.concepts import ConceptSet

    path = Path(spec["path"])
    if file_digest(path) != spec["sha256"]:
        raise RuntimeError(f"concept set {path} changed after the engine was configured")
    concepts = ConceptSet.load(path)
    held, layers = decoder_stack(model)
    buffer = torch.zeros(max_tokens, len(concepts.layers), len(concepts.concepts), dtype=torch.float32, device=device)
    for slot, index in enumerate(concepts.layers):
        if index not in held:
            continue  # another pipeline stage holds this layer
        matrix = concepts.vectors[index].to(device=device, dtype=torch.float32).T.contiguous()
        layers[index] = ReadoutTap(layers[index], slot, matrix, buffer)
    log.debug("readout taps installed", extra={"layers": concepts.layers, "rows": max_tokens})


def _register_loader() -> None:
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register_model_loader(LOAD_FORMAT)
    class SalienceLoader(DefaultModelLoader):
        """vLLM's default loader, then readout taps on the concept set's layers."""

        def __init__(self, load_config) -> None:
            # The weights themselves are found as "auto" finds them.
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_model(self, vllm_config, model_config, prefix: str = "") -> nn.Module:
            model = super().load_model(vllm_config, model_config, prefix)
            spec = (vllm_config.additional_config or {}).get(CONFIG_KEY)
            if spec is not None:  # every rank taps (the same values); rank 0's are read
                rows = vllm_config.scheduler_config.max_num_batched_tokens
                device = next(model.parameters()).device
                _install_taps(model, spec, rows, device)
            return model


_register_loader()
