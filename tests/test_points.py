"""Hook points outside the engine: a concept set names its point in its file, older files read the
layer's output, and a point a family lacks is refused before vLLM starts. The numbers at every
point, against transformers, are in test_families.py (each family's set reads one point)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.steering import Directions
from salience.errors import ModelError
from tests.conftest import random_concepts
from tests.test_families import family_folder


def test_a_set_keeps_its_point_and_a_set_at_resid_post_keeps_its_digest(tiny_model: Path, tmp_path: Path) -> None:
    at_post = random_concepts(tiny_model, ("a", "b"), (0, 2), 1, tmp_path / "post.safetensors")
    at_mid = random_concepts(tiny_model, ("a", "b"), (0, 2), 1, tmp_path / "mid.safetensors", point="resid_mid")
    assert (at_post.point, at_mid.point, at_mid.manifest.point) == ("resid_post", "resid_mid", "resid_mid")
    assert at_mid.digest() != at_post.digest()
    # the digest a resid_post set had before sets named points: names, layers, shape, model, bytes
    h = hashlib.sha256(json.dumps([("a", "b"), (0, 2), 128, at_post.model_fingerprint]).encode())
    for layer in (0, 2):
        h.update(at_post.vectors[layer].contiguous().numpy().tobytes())
    assert at_post.digest() == h.hexdigest()


def test_a_file_without_a_point_reads_the_layers_output_and_an_unknown_point_is_refused(
    tiny_model: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "mid.safetensors"
    random_concepts(tiny_model, ("a",), (1,), 2, path, point="mlp_out")
    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata())
    assert meta["point"] == "mlp_out"
    tensors = load_file(str(path))
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={k: v for k, v in meta.items() if k != "point"})
    assert ConceptSet.load(tmp_path / "old.safetensors").point == "resid_post"
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={**meta, "point": "hook_z"})
    with pytest.raises(ModelError, match=r"concept set point 'hook_z' is not one of resid_pre, resid_mid, "):
        ConceptSet.load(tmp_path / "bad.safetensors")


def test_steering_and_readouts_must_be_one_point(tiny_model: Path, tmp_path: Path) -> None:
    concepts = random_concepts(tiny_model, ("a",), (1,), 2, tmp_path / "c.safetensors", point="attn_out")
    steering = random_concepts(tiny_model, ("b",), (1,), 3, tmp_path / "s.safetensors")
    with pytest.raises(ModelError, match="the steering set steers at resid_post and the concept set reads attn_out"):
        Directions(concepts, steering)
    assert Directions(concepts, dataclasses.replace(steering, point="attn_out")).point == "attn_out"


async def test_a_set_at_a_point_the_family_lacks_is_refused_before_vllm_starts(
    tiny_model: Path, tmp_path: Path
) -> None:
    neox = family_folder("gpt_neox", tiny_model)
    concepts = random_concepts(neox, ("a",), (1,), 2, tmp_path / "c.safetensors", point="resid_mid")
    settings = EngineSettings(model=neox, served_model_name="t", kv_cache_gib=0.25, concepts=concepts)
    with pytest.raises(ModelError, match=r"^the concept set reads resid_mid, but GPT-NeoX models have no hook point "):
        await Engine.start(settings)
