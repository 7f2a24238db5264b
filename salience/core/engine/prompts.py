"""What vLLM is given as a prompt: token ids, or ids with images in their vision blocks, and the
check that vLLM expanded them into exactly the client's tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from salience.core.engine.images import Vision, collapse
from salience.errors import EngineError, InvalidArgument

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

__all__ = ["PlacedImage", "Prompt", "check_expansion", "submission", "tokens_prompt"]


@dataclasses.dataclass(frozen=True)
class PlacedImage:
    """A decoded image and its vision block [start, end) in the prompt."""

    start: int
    end: int
    image: object  # PIL.Image.Image


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A prompt as the model reads it: token ids (each vision block expanded to its image's
    pads) and the images placed in those blocks."""

    tokens: tuple[int, ...]
    images: tuple[PlacedImage, ...] = ()


def check_expansion(out: RequestOutput, expected: list[int]) -> None:
    """vLLM expands each image's single pad itself: its prompt must be the client's tokens."""
    if out.prompt_token_ids is not None and list(out.prompt_token_ids) != expected:
        got = list(out.prompt_token_ids)
        at = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
        )
        raise EngineError(
            f"vLLM expanded the prompt to {len(got)} tokens, not the session's {len(expected)}; first difference "
            f"at position {at}"
        )


def submission(vision: Vision | None, model_name: str, tokens: list[int], images: Sequence[PlacedImage]):
    """The prompt as vLLM takes it: one pad per image, the images alongside."""
    if vision is None and not images:
        return tokens_prompt(tokens)
    vision = Vision.of(vision, model_name)
    placed = sorted(images, key=lambda i: i.start)
    inside = {p for i in placed for p in range(i.start, i.end)}
    for position, token in enumerate(tokens):
        if token in (vision.start, vision.end, vision.pad, vision.video_pad) and position not in inside:
            raise InvalidArgument(
                f"position {position} holds vision token {token} outside any attached image's block: "
                "attach the image, or leave vision tokens out"
            )
    if not placed:
        return tokens_prompt(tokens)
    from vllm.inputs import TokensPrompt

    collapsed = collapse(tokens, [(i.start, i.end) for i in placed], vision.pad)
    return TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": [i.image for i in placed]})


def tokens_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)
