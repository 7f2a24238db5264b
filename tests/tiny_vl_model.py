"""Builds the tiny test VL model: a random Qwen2-VL on the tiny text model's tokenizer.

No small vision-language model ships in any package, so the image tests build
their own: the tiny text model's size (hidden 128, 4 layers, head dim 32, the
smallest the CPU attention backend accepts), a 2-layer vision tower, and a small
pixel budget so every test image is a handful of pads. mrope_section sums to
head_dim / 2. The conftest caches the folder keyed by this file's content and the
tiny model's sources.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

VISION_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>"]
CHAT_SPECIALS = ["<|im_start|>", "<|im_end|>"]
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 64
# Qwen's chat template, reduced to what the tests need: one vision block per image.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vl_model(out: Path, text_model: Path | None = None) -> None:
    """Writes config, float32 weights, tokenizer and processor to `out`.

    `text_model` is the tiny text model's folder (the `tiny_model` fixture), whose
    tokenizer is extended; without it the text model is built in a scratch folder.
    """
    if text_model is None:
        from tests.tiny_model import build_tiny_model

        with tempfile.TemporaryDirectory() as scratch:
            build_tiny_model(Path(scratch))
            return build_tiny_vl_model(out, Path(scratch))

    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from salience.core.models.portable import make_portable

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    tokenizer.add_special_tokens({"additional_special_tokens": CHAT_SPECIALS + VISION_SPECIALS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_SPECIALS}

    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=(len(tokenizer) + 63) // 64 * 64,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=64,
            hidden_size=128,  # the merger's output: the text hidden size
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = Qwen2VLForConditionalGeneration(config)
    with torch.no_grad():  # a peakier random net, so greedy decoding has clear winners (as the text model)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)

    # Qwen2VLProcessor insists on a video processor, which needs an importable torchvision.
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        video_processor=Qwen2VLVideoProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    make_portable(out)


if __name__ == "__main__":
    build_tiny_vl_model(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
