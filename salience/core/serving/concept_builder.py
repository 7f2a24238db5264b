"""Build a concept set from contrastive example texts, through the vLLM engine itself.

Spec (JSON or YAML):

    name: my-concepts
    layers: all            # or a list of layer indices
    concepts:
      - name: french
        positive: ["Le chat dort sur le canapé.", ...]
        negative: ["The cat sleeps on the sofa.", ...]

For every concept and layer the vector is mean(positive) - mean(negative) of the
residual stream, averaged over each text's tokens and then over texts, then
normalised to unit length. A text's first token is left out: its residual has a
norm orders of magnitude above the rest in every text (an attention sink), so
it would swamp the means while saying nothing about the text. The residuals come from the same readout hooks the
server uses, with identity matrices as "concepts", so the builder measures
exactly what serving will project.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings
from salience.core.models.folders import model_fingerprint, model_shape
from salience.core.probes.concepts import ConceptSet
from salience.errors import InvalidArgument

__all__ = ["build_concept_set", "load_spec"]


def load_spec(path: Path) -> dict[str, Any]:
    try:
        spec = yaml.safe_load(path.read_text())  # JSON is YAML too
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"cannot read concept spec {path}: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("concepts"), list) or not spec["concepts"]:
        raise InvalidArgument(f"{path}: a spec needs a non-empty 'concepts' list")
    for i, concept in enumerate(spec["concepts"]):
        if not isinstance(concept, dict) or not isinstance(concept.get("name"), str):
            raise InvalidArgument(f"{path}: concept {i} needs a 'name'")
        for side in ("positive", "negative"):
            texts = concept.get(side)
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
                raise InvalidArgument(f"{path}: concept {concept['name']!r} needs a non-empty '{side}' list of texts")
    return spec


async def build_concept_set(spec: dict[str, Any], model: Path, *, source: str = "") -> ConceptSet:
    hidden, num_layers = model_shape(model)
    layers = list(range(num_layers)) if spec.get("layers", "all") == "all" else [int(x) for x in spec["layers"]]
    fingerprint = model_fingerprint(model)
    identity = ConceptSet(
        concepts=tuple(f"d{i}" for i in range(hidden)),
        vectors={layer: torch.eye(hidden) for layer in layers},
        hidden_size=hidden,
        num_layers=num_layers,
        model_fingerprint=fingerprint,
    )
    started = time.monotonic()
    engine = await Engine.start(
        EngineSettings(model=model, served_model_name="concept-builder", concepts=identity, max_model_len=2048)
    )
    try:
        texts = [(c["name"], side, t) for c in spec["concepts"] for side in ("positive", "negative") for t in c[side]]
        means: dict[tuple[str, str], list[torch.Tensor]] = {}
        for name, side, text in tqdm(texts, desc="reading example texts", unit="text"):
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) < 2:
                raise InvalidArgument(f"example text {text!r} is a single token; it needs at least two")
            readouts = await engine.readout(ids, [(1, len(ids))])
            stacked = torch.tensor([readouts[p] for p in range(1, len(ids))], dtype=torch.float64)
            means.setdefault((name, side), []).append(stacked.reshape(len(ids) - 1, len(layers), hidden).mean(0))
    finally:
        engine.shutdown()
    names = tuple(c["name"] for c in spec["concepts"])
    vectors = {}
    for i, layer in enumerate(layers):
        rows = []
        for name in names:
            direction = (
                torch.stack(means[(name, "positive")]).mean(0)[i] - torch.stack(means[(name, "negative")]).mean(0)[i]
            )
            rows.append(direction / direction.norm())
        vectors[layer] = torch.stack(rows).to(torch.float32)
    return ConceptSet(
        concepts=names,
        vectors=vectors,
        hidden_size=hidden,
        num_layers=num_layers,
        model_fingerprint=fingerprint,
        provenance={
            "method": "difference of class means of the residual stream (first token left out), unit-normalised",
            "spec": spec.get("name") or source,
            "examples": {name: [len(means[(name, "positive")]), len(means[(name, "negative")])] for name in names},
            "model": str(model),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
        },
    )


def describe(concept_set: ConceptSet) -> str:
    manifest = concept_set.manifest
    return json.dumps(
        {
            "concepts": list(manifest.concepts),
            "layers": list(manifest.layers),
            "hidden_size": manifest.hidden_size,
            "dtype": manifest.dtype,
            "num_layers": concept_set.num_layers,
            "model_fingerprint": concept_set.model_fingerprint,
            "provenance": concept_set.provenance,
        },
        indent=2,
        ensure_ascii=False,
    )
