"""The embedded default model: conversion, and the engine on real text against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from salience.core.engine.engine import Engine
from salience.core.engine.requests import SamplingOptions
from salience.core.models.atomic import build_folder_once
from tests.reference import Reference, assert_logprobs_match

TOL = 1e-4


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    return default_engine  # compiled, with the concept taps: as `salience serve` runs it


@pytest.fixture(scope="module")
def reference(default_model: Path) -> Reference:
    return Reference(default_model)


@pytest.fixture(scope="module")
def tokenizer(default_model: Path):
    return AutoTokenizer.from_pretrained(default_model)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_converted_folder_is_float32_and_portable(default_model: Path) -> None:
    config = json.loads((default_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert "quantization_config" not in config
    # transformers 5.x reads rope_parameters, 4.x (LMQL's side) the top-level key: both say 100000.
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    tokenizer_config = json.loads((default_model / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


async def test_greedy_text_matches_reference_token_for_token(engine: Engine, reference: Reference, tokenizer) -> None:
    prompt = chat(tokenizer, "What is the capital of France?")
    generation = engine.generate(prompt, SamplingOptions(max_tokens=32, temperature=0.0, logprobs=5, ignore_eos=True))
    events = [event async for event in generation]
    tokens = [e.token_id for e in events]
    assert tokens == reference.greedy(prompt, 32)
    assert "Paris" in tokenizer.decode(tokens)
    assert_logprobs_match(events, reference.logprobs(prompt + tokens), 5)


async def test_score_matches_reference(engine: Engine, reference: Reference, tokenizer) -> None:
    prompt = tokenizer("The quick brown fox")["input_ids"]
    continuation = tokenizer(" jumps over the lazy dog.")["input_ids"]
    scored = await engine.score(prompt, continuation, top_logprobs=2)
    assert [s.token_id for s in scored] == continuation
    assert [s.position for s in scored] == list(range(len(prompt), len(prompt) + len(continuation)))
    assert_logprobs_match(scored, reference.logprobs(prompt + continuation), 2, TOL)
    assert sum(s.logprob for s in scored) > -20  # a likely sentence, so the model really is SmolLM2


def test_interrupted_build_leaves_nothing_behind(tmp_path: Path) -> None:
    target = tmp_path / "model"

    def crash(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_folder_once(target, crash)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".model.lock"]
    build_folder_once(target, lambda out: (out / "ok").write_text("1"))
    assert (target / "ok").read_text() == "1"
    build_folder_once(target, lambda out: pytest.fail("built twice"))
