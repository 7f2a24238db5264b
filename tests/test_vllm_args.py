"""The compiled-or-eager choice, without starting an engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.vllm_args import compiled
from salience.core.probes.concepts import ConceptSet


def settings(folder: Path, architecture: str, concepts: ConceptSet | None, compile: bool = True) -> EngineSettings:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return EngineSettings(model=folder, served_model_name="m", concepts=concepts, compile=compile)


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen2VLForConditionalGeneration"])
def test_proven_architectures_compile_with_readouts(
    tmp_path: Path, tiny_concepts: ConceptSet, architecture: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert compiled(settings(tmp_path, architecture, tiny_concepts))
    assert not caplog.records


def test_another_architecture_runs_its_readouts_eagerly_with_one_warning(
    tmp_path: Path, tiny_concepts: ConceptSet, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert not compiled(settings(tmp_path, "MistralForCausalLM", tiny_concepts))
    [record] = caplog.records
    assert "readouts run eagerly" in record.getMessage() and record.architecture == "MistralForCausalLM"
    # Without readouts nothing stands in the way of compiling it; --eager is always eager.
    assert compiled(settings(tmp_path, "MistralForCausalLM", None))
    assert not compiled(settings(tmp_path, "Qwen2ForCausalLM", tiny_concepts, compile=False))
