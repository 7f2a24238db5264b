"""A turn's image attachments checked against the session's tokens after its append: each
attachment names a whole vision block of the append, with exactly the pads its image needs, and
every vision token the append writes lies in an attached block."""

from __future__ import annotations

import itertools

from salience.core.engine.images import ImageFacts, Vision
from salience.core.engine.prompts import PlacedImage
from salience.core.serving.turns import Turn
from salience.errors import InvalidArgument

__all__ = ["place_images"]


def place_images(vision: Vision, turn: Turn, tokens: list[int], facts: list[ImageFacts]) -> list[PlacedImage]:
    """Check the turn's attachments against the tokens after the append; every vision block
    written in the append must be attached, and each must hold exactly the pads its image needs."""
    placed = []
    for i, (block, fact) in enumerate(zip(turn.images, facts, strict=True)):
        what = f"images[{i}]"
        start, end = block.start, block.end
        if not turn.offset <= start < end <= len(tokens):
            raise InvalidArgument(
                f"{what}: block [{start}, {end}) must lie in this call's appended tokens "
                f"[{turn.offset}, {len(tokens)})",
                field=what,
            )
        if tokens[start] != vision.start or tokens[end - 1] != vision.end or end - start < 3:
            raise InvalidArgument(
                f"{what}: block [{start}, {end}) must run from <|vision_start|> ({vision.start}) to <|vision_end|> "
                f"({vision.end}) inclusive, with image pads between",
                field=what,
            )
        stray = next((p for p in range(start + 1, end - 1) if tokens[p] != vision.pad), None)
        if stray is not None:
            raise InvalidArgument(
                f"{what}: position {stray} inside the block is {tokens[stray]}, not <|image_pad|> ({vision.pad})",
                field=what,
            )
        if end - start - 2 != fact.pads:
            t, h, w = fact.grid
            raise InvalidArgument(
                f"{what}: the block holds {end - start - 2} image pads; this image needs {fact.pads} "
                f"(grid {t}x{h}x{w} patches, merged 2x2), so the block is {fact.pads + 2} tokens long",
                field=what,
            )
        placed.append(PlacedImage(start=start, end=end, image=fact.image))
    placed.sort(key=lambda p: p.start)
    for a, b in itertools.pairwise(placed):
        if b.start < a.end:
            raise InvalidArgument(f"image blocks [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap")
    inside = {p for block in placed for p in range(block.start, block.end)}
    special = {vision.start, vision.end, vision.pad, vision.video_pad}
    loose = next((p for p in range(turn.offset, len(tokens)) if tokens[p] in special and p not in inside), None)
    if loose is not None and tokens[loose] == vision.start:
        raise InvalidArgument(f"the vision block starting at position {loose} has no image attached (images[] entry)")
    if loose is not None:
        raise InvalidArgument(f"position {loose} holds vision token {tokens[loose]} outside any attached image's block")
    return placed
