"""Tiny random models of every family Salience reads (salience/core/models/families), built in
seconds from transformers' config classes: 4 layers, hidden 128, 4 heads of 32 (the smallest
head the CPU attention backend takes), the tiny Qwen2 model's tokenizer.

Each family's settings exercise what sets it apart: Gemma 2's soft-caps and alternating sliding
windows (a window shorter than the tests' long prompt), Gemma 3's sliding and global layers,
Granite's multipliers, GPT-NeoX's parallel residual and partial rotary, GPT-2's learned positions.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
WINDOW = 64  # sliding layers see this many positions: less than the tests' long prompts
GEMMA = dict(COMMON, query_pre_attn_scalar=32, tie_word_embeddings=True)

# family name -> (transformers model class, config class, its settings)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", COMMON),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(COMMON, sliding_window=None)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(COMMON, partial_rotary_factor=0.5)),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", GEMMA),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(GEMMA, sliding_window=WINDOW, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(GEMMA, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2),
    ),
    "granite": (
        "GraniteForCausalLM",
        "GraniteConfig",
        dict(COMMON, embedding_multiplier=4.0, residual_multiplier=0.5, logits_scaling=0.25, attention_multiplier=0.05),
    ),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", COMMON),
    "gpt2": (
        "GPT2LMHeadModel",
        "GPT2Config",
        dict(n_embd=128, n_layer=4, n_head=4, n_inner=256, n_positions=2048),
    ),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=2048,
            partial_rotary_factor=0.25,
            use_parallel_residual=True,
        ),
    ),
}


def build_family_model(family: str, out: Path, tokenizer: Path, seed: int = 0) -> None:
    """The family's tiny model in `out` (random weights from `seed`), with `tokenizer`'s files (a
    folder holding one)."""
    import torch
    import transformers

    from salience.core.models.portable import make_portable

    model_class, config_class, settings = FAMILIES[family]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    config = getattr(transformers, config_class)(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
        **settings,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # a peakier random net, so greedy decoding has clear winners
        model.get_output_embeddings().weight.mul_(4.0)
    model.save_pretrained(out, safe_serialization=True)
    make_portable(out)
