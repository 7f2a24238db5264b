"""The independent reference for image prompts: transformers' Qwen2-VL in float32 on the same weights.

It takes the token list the client sees, with every vision block already expanded
(`<|vision_start|> + N x <|image_pad|> + <|vision_end|>`), and the block's images in
order, so its rows line up with the session's positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from PIL.Image import Image

from tests.reference import layer_outputs


def expected_pads(folder: Path, image: Image) -> tuple[int, tuple[int, int, int]]:
    """N for one image (patch grid / merge_size**2) and its grid_thw, as the model's processor says."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(folder)
    grid = tuple(int(x) for x in processor(images=[image], return_tensors="pt")["image_grid_thw"][0])
    return math.prod(grid) // processor.merge_size**2, grid


class VlReference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoImageProcessor, Qwen2VLForConditionalGeneration

        self.model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.image_pad = self.model.config.image_token_id

    def _inputs(self, ids: Sequence[int], images: Sequence[Image]) -> dict[str, torch.Tensor]:
        input_ids = torch.tensor([list(ids)])
        # transformers 5 marks image positions itself only when it tokenizes; here the ids come given.
        inputs = {"input_ids": input_ids, "mm_token_type_ids": (input_ids == self.image_pad).long()}
        if images:
            pixels = self.image_processor(images=list(images), return_tensors="pt")
            inputs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        return inputs

    @torch.no_grad()
    def logits(self, ids: Sequence[int], images: Sequence[Image]) -> torch.Tensor:
        """Next-token logits after each prefix: row i predicts ids[i + 1]."""
        return self.model(**self._inputs(ids, images)).logits[0].double()

    def logprobs(
        self, ids: Sequence[int], images: Sequence[Image], bias: Mapping[int, float] | None = None
    ) -> torch.Tensor:
        logits = self.logits(ids, images)
        for token, value in (bias or {}).items():
            logits[:, token] += value
        return torch.log_softmax(logits, dim=-1)

    def greedy(self, prompt: Sequence[int], images: Sequence[Image], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids, images)[-1].argmax()))
        return ids[len(prompt) :]

    def residuals(self, ids: Sequence[int], images: Sequence[Image], layers: Sequence[int]) -> dict[int, torch.Tensor]:
        """Each text layer's output (the residual stream before the final norm), [positions, hidden]."""
        decoder = self.model.model.language_model.layers
        return layer_outputs(self.model, decoder, layers, **self._inputs(ids, images))
