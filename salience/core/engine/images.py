"""Images for Qwen-VL-family models: decode, check, and count the pads the model makes of them.

The client writes each image's whole vision block into its tokens,
`<|vision_start|> + N x <|image_pad|> + <|vision_end|>`, and the server is the source of truth
for N: what the model's image processor yields for that image (its patch grid divided by the
spatial merge). vLLM 0.32 expects ONE pad per image in a token prompt and expands it itself, so
the engine collapses every block before submitting (`collapse`) and checks that vLLM's expansion
gives back exactly the session's tokens.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from PIL.Image import Image

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "ImageFacts", "Vision", "collapse"]

MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # decoded size: a small file can decode to a huge bitmap
_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}


@dataclass(frozen=True)
class ImageFacts:
    """A decoded image (RGB; an animation's first frame) and what the model makes of it."""

    image: Image
    pads: int  # N: <|image_pad|> tokens of its vision block
    grid: tuple[int, int, int]  # image_grid_thw: temporal, height, width patches

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size  # width, height


@dataclass(frozen=True)
class Vision:
    """The served model's vision side: its block tokens and image processor."""

    start: int  # <|vision_start|>
    end: int  # <|vision_end|>
    pad: int  # <|image_pad|>
    video_pad: int | None
    processor: object

    @staticmethod
    def of(engine_vision: Vision | None, model_name: str) -> Vision:
        """The vision side, or InvalidArgument saying the model has none."""
        if engine_vision is None:
            raise InvalidArgument(f"model {model_name!r} takes no images: it has no vision encoder")
        return engine_vision

    @staticmethod
    def load(model: Path) -> Vision | None:
        """The model's vision side, or None for a text-only model."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
        if getattr(config, "vision_config", None) is None or getattr(config, "image_token_id", None) is None:
            return None
        from transformers import AutoImageProcessor

        return Vision(
            start=config.vision_start_token_id,
            end=config.vision_end_token_id,
            pad=config.image_token_id,
            video_pad=getattr(config, "video_token_id", None),
            processor=AutoImageProcessor.from_pretrained(model),
        )

    def inspect(self, data: bytes, mime: str, what: str = "image") -> ImageFacts:
        """Decode and measure one image; InvalidArgument naming `what` if it cannot be used."""
        from PIL import Image, UnidentifiedImageError

        expected = _FORMATS.get(mime.lower().strip())
        if expected is None:
            raise InvalidArgument(f"{what}: mime {mime!r} is not one of {', '.join(sorted(set(_FORMATS)))}", field=what)
        if not data:
            raise InvalidArgument(f"{what}: the image has no bytes", field=what)
        if len(data) > MAX_IMAGE_BYTES:
            raise InvalidArgument(f"{what}: {len(data)} bytes exceed the limit of {MAX_IMAGE_BYTES}", field=what)
        try:
            opened = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError) as exc:
            raise InvalidArgument(f"{what}: the bytes do not decode as an image ({exc})", field=what) from None
        if opened.format != expected:
            raise InvalidArgument(f"{what}: declared {mime} but the bytes are {opened.format or 'unknown'}", field=what)
        width, height = opened.size
        if width * height > MAX_IMAGE_PIXELS:
            raise InvalidArgument(f"{what}: {width}x{height} pixels exceed the limit of {MAX_IMAGE_PIXELS}", field=what)
        try:
            opened.seek(0)  # an animation's first frame
            image = opened.convert("RGB")
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{what}: the image is truncated or corrupt ({exc})", field=what) from None
        grid = self.processor(images=[image], return_tensors="np")["image_grid_thw"][0]
        merge = getattr(self.processor, "merge_size", 2)
        thw = (int(grid[0]), int(grid[1]), int(grid[2]))
        return ImageFacts(image=image, pads=math.prod(thw) // merge**2, grid=thw)


def collapse(tokens: Sequence[int], blocks: Sequence[tuple[int, int]], pad: int) -> list[int]:
    """The tokens with each vision block [start, end) reduced to start + one pad + end,
    the form vLLM expands itself. Blocks must be sorted and not overlap."""
    out: list[int] = []
    at = 0
    for start, end in blocks:
        out += tokens[at : start + 1]
        out.append(pad)
        out.append(tokens[end - 1])
        at = end
    out += tokens[at:]
    return out
