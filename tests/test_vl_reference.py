"""The image tests' foundation, engine-free: the tiny VL model, its test images, and the reference.

The numbers here are what the tiny model's processor makes of each test image
(min_pixels 56*56, max_pixels 28*28*64, 14-pixel patches merged 2x2). vLLM's prompt
logprobs on the expanded prompt matched VlReference within 2.1e-6 when this was written
(one pad per image submitted, 1, 2 and 1 images; lm_head scaled x4 makes the logits larger than the probe's).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.images import FORMATS, decode, image_bytes, pattern
from tests.reference import reference_readouts
from tests.vl_reference import VlReference, expected_pads

# format, size (width, height), N, grid_thw
CASES = [
    ("PNG", (112, 84), 12, (1, 6, 8)),
    ("JPEG", (200, 150), 35, (1, 10, 14)),
    ("WEBP", (56, 56), 4, (1, 4, 4)),
    ("GIF", (300, 40), 11, (1, 2, 22)),
]


@pytest.fixture(scope="module")
def vl_reference(tiny_vl_model: Path) -> VlReference:
    return VlReference(tiny_vl_model)


def block(reference: VlReference, n: int) -> list[int]:
    config = reference.model.config
    return [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id]


def test_vision_tokens_are_single_specials(tiny_vl_model: Path, tiny_model: Path) -> None:
    """The VL tokenizer is the tiny model's plus the vision specials, whose ids the config names."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_vl_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_model)
    text = "def f(x):\n    return x ** 2  # wörld"
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(tiny_model)(text)["input_ids"]
    marked = "<|vision_start|><|image_pad|><|vision_end|>"
    ids = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    assert tokenizer(marked)["input_ids"] == ids
    assert config.text_config.vocab_size >= len(tokenizer)


@pytest.mark.parametrize(("fmt", "size", "n", "grid"), CASES, ids=[c[0] for c in CASES])
def test_expected_pads_is_what_the_processor_expands(
    tiny_vl_model: Path, fmt: str, size: tuple[int, int], n: int, grid: tuple[int, int, int]
) -> None:
    from transformers import AutoProcessor

    image = decode(image_bytes(fmt, size))
    assert image.size == size
    assert expected_pads(tiny_vl_model, image) == (n, grid)
    processor = AutoProcessor.from_pretrained(tiny_vl_model)
    expanded = processor(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="pt")
    assert int((expanded["input_ids"] == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum()) == n


def test_images_are_deterministic_and_seeded() -> None:
    for fmt in FORMATS:
        assert image_bytes(fmt) == image_bytes(fmt)
        assert image_bytes(fmt, seed=0) != image_bytes(fmt, seed=1)


def test_gif_decodes_to_its_first_frame() -> None:
    """The second frame is the first inverted, so using it would be far off."""
    got = torch.tensor(list(decode(image_bytes("GIF")).getdata()), dtype=torch.float)
    want = torch.tensor(list(pattern().getdata()), dtype=torch.float)
    assert (got - want).abs().mean() < 8


def test_reference_with_two_images(vl_reference: VlReference) -> None:
    images = [decode(image_bytes("PNG", (112, 84), seed=0)), decode(image_bytes("WEBP", (56, 56), seed=1))]
    text = [11, 12, 13]
    ids = text + block(vl_reference, 12) + text + block(vl_reference, 4) + text
    logprobs = vl_reference.logprobs(ids, images)
    assert logprobs.shape == (len(ids), vl_reference.model.config.text_config.vocab_size)
    assert torch.isfinite(logprobs).all()
    assert torch.allclose(logprobs.exp().sum(-1), torch.ones(len(ids), dtype=torch.float64))

    # The images matter: other pixels change the rows after the first block, not those before it.
    other = vl_reference.logprobs(ids, [decode(image_bytes("PNG", (112, 84), seed=5)), images[1]])
    assert torch.equal(other[: len(text) + 1], logprobs[: len(text) + 1])
    assert (other[-1] - logprobs[-1]).abs().max() > 1e-4

    residuals = vl_reference.residuals(ids, images, [0, 3])
    assert set(residuals) == {0, 3}
    assert all(r.shape == (len(ids), 128) and torch.isfinite(r).all() for r in residuals.values())
    # The last layer's hook reads before the final norm: normed, it is what the head sees.
    model = vl_reference.model
    with torch.no_grad():
        normed = model.model.language_model.norm(residuals[3].float())
        assert torch.allclose(model.lm_head(normed).double().log_softmax(-1), logprobs, atol=1e-5)

    vectors = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    concepts = SimpleNamespace(layers=(0, 3), vectors={0: vectors, 3: vectors})
    readouts = reference_readouts(vl_reference, concepts, ids, images)
    assert readouts.shape == (len(ids), 4)
    assert torch.allclose(readouts[:, 2:], residuals[3] @ vectors.double().T)
