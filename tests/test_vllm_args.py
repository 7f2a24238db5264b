"""The compiled-or-eager choice and the family a model is read as, without starting an engine."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.vllm_args import compiled
from salience.core.models.families import families
from salience.core.models.folders import model_family
from salience.core.probes.concepts import ConceptSet
from salience.errors import ModelError


def settings(folder: Path, architecture: str, concepts: ConceptSet | None, compile: bool = True) -> EngineSettings:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return EngineSettings(model=folder, served_model_name="m", concepts=concepts, compile=compile)


@pytest.mark.parametrize("architecture", sorted(a for a, f in families().items() if f.compiled))
def test_proven_families_compile_with_readouts(
    tmp_path: Path, tiny_concepts: ConceptSet, architecture: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert compiled(settings(tmp_path, architecture, tiny_concepts))
    assert not caplog.records


def test_a_family_not_proven_compiled_runs_its_readouts_eagerly_with_one_warning(
    tmp_path: Path, tiny_concepts: ConceptSet, caplog: pytest.LogCaptureFixture
) -> None:
    architecture = "Gemma3ForConditionalGeneration"
    assert not families()[architecture].compiled
    with caplog.at_level(logging.WARNING):
        assert not compiled(settings(tmp_path, architecture, tiny_concepts))
    [record] = caplog.records
    assert "readouts run eagerly" in record.getMessage() and record.family == "Gemma 3 (multimodal)"
    # Without readouts nothing stands in the way of compiling it; --eager is always eager.
    assert compiled(settings(tmp_path, architecture, None))
    assert not compiled(settings(tmp_path, "Qwen2ForCausalLM", tiny_concepts, compile=False))


def test_an_architecture_no_family_reads_is_refused_naming_what_is_read(tmp_path: Path) -> None:
    with pytest.raises(
        ModelError,
        match=r"architecture MambaForCausalLM is not one Salience can read; it reads .*"
        r"GPT2LMHeadModel.* \(--no-readouts serves any model vLLM does",
    ):
        model_family(settings(tmp_path, "MambaForCausalLM", None).model)
