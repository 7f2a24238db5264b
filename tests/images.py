"""Small deterministic test images, encoded as a client would send them.

Each seed draws a different coarse colour grid, so two images of the same size
give different vision features (a test that swaps or drops an image notices).
An animated GIF's second frame is the first one inverted: using the wrong frame
changes the model's output.
"""

from __future__ import annotations

import io
import random

from PIL import Image

__all__ = ["FORMATS", "MIME", "decode", "image_bytes", "pattern"]

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_CELL = 7  # pixels per grid cell: coarse enough to survive JPEG and the GIF palette


def pattern(size: tuple[int, int] = (112, 84), seed: int = 0) -> Image.Image:
    """An RGB image of `size` (width, height): a seeded grid of random colours."""
    rng = random.Random(seed)
    width, height = size
    cols, rows = -(-width // _CELL), -(-height // _CELL)
    grid = Image.new("RGB", (cols, rows))
    grid.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(cols * rows)])
    return grid.resize((cols * _CELL, rows * _CELL), Image.Resampling.NEAREST).crop((0, 0, width, height))


def image_bytes(fmt: str, size: tuple[int, int] = (112, 84), seed: int = 0) -> bytes:
    """The pattern encoded as PNG, JPEG, WebP or a 2-frame animated GIF (fmt is case-insensitive)."""
    fmt = fmt.upper()
    image = pattern(size, seed)
    out = io.BytesIO()
    if fmt == "PNG":
        image.save(out, "PNG")
    elif fmt in ("JPEG", "JPG"):
        image.save(out, "JPEG", quality=90)
    elif fmt == "WEBP":
        image.save(out, "WEBP", quality=90, method=4)
    elif fmt == "GIF":
        second = Image.eval(image, lambda v: 255 - v)
        image.save(out, "GIF", save_all=True, append_images=[second], duration=100, loop=0)
    else:
        raise ValueError(f"unknown image format {fmt!r}: use one of {FORMATS}")
    return out.getvalue()


def decode(data: bytes) -> Image.Image:
    """The image as the model sees it: RGB, an animation's first frame."""
    opened = Image.open(io.BytesIO(data))
    opened.seek(0)
    return opened.convert("RGB")
