"""A sparse autoencoder's encoder as the model's layer tap runs it (probes/taps.py), compiled
into the forward: SAELens's encode math (sae.py says which), keeping each token's largest
features, so only those leave the graph. Imported in the engine's workers only (it needs vLLM)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm import _custom_ops as ops

__all__ = ["SAEEncoder"]


class SAEEncoder(nn.Module):
    """One sparse autoencoder's encoder at its layer: a token's `width` largest feature activations
    as [ids (as float32: exact below 2**24) | activations], largest first. `width` is the most a
    request may ask for; a top-k SAE keeps at most its k."""

    def __init__(self, sae: Any, width: int, slot: int) -> None:
        super().__init__()
        self.slot = slot
        self.width = width
        self.topk = sae.architecture == "topk"
        self.centre = bool(sae.apply_b_dec_to_input)
        self.register_buffer("W_enc", sae.W_enc.contiguous(), persistent=False)
        self.register_buffer("b_enc", sae.b_enc, persistent=False)
        self.register_buffer("b_dec", sae.b_dec, persistent=False)
        threshold = sae.threshold if sae.architecture == "jumprelu" else None
        self.jump = threshold is not None
        self.register_buffer("threshold", threshold if threshold is not None else torch.zeros(0), persistent=False)
        self.packed: Any = None  # W_enc prepacked for oneDNN (CPU)

    def prepack(self) -> None:
        """On CPU, encode through oneDNN with W_enc prepacked, as vLLM runs the model's own linear
        layers: ATen's addmm took ~3x as long per weight byte (2.9% of a decode step at 8 streams
        for an 8x SAE of the default model)."""
        if self.W_enc.device.type == "cpu" and ops._supports_onednn:
            self.packed = ops.create_onednn_mm(self.W_enc, 32)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        centred = state - self.b_dec if self.centre else state
        if self.packed is not None:
            pre = ops.onednn_mm(self.packed, centred, self.b_enc)
        else:
            pre = centred @ self.W_enc + self.b_enc
        if self.topk:  # the k largest pre-activations, ReLU'd; every other feature is 0
            values, ids = torch.topk(pre, self.width, dim=-1)
            values = torch.relu(values)
        else:
            acts = torch.relu(pre)
            if self.jump:
                acts = acts * (pre > self.threshold)
            values, ids = torch.topk(acts, self.width, dim=-1)
        return torch.cat([ids.to(torch.float32), values], dim=-1)
