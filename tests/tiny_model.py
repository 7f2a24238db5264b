"""Builds the tiny test model: a random Qwen2 with a locally trained BPE tokenizer.

Small enough to load in seconds, yet a real architecture vLLM serves. The
conftest caches the folder keyed by this file's content, so editing the builder
rebuilds it. Head dim 32 is the smallest the CPU attention backend accepts.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Qwen2's own pre-tokenizer: transformers 5 rebuilds it for every qwen2 folder
# whatever tokenizer.json says, so the tokenizer must be trained with it for
# transformers 4 (LMQL's client) and 5 (the server) to tokenize alike.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tiny_model(out: Path) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from salience.core.models.portable import make_portable

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(files, trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    hf_tokenizer.model_max_length = 2048
    hf_tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(hf_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # a peakier random net, so greedy decoding has clear winners
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    make_portable(out)


if __name__ == "__main__":
    build_tiny_model(Path(sys.argv[1]))
