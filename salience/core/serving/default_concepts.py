"""The default concept set for any model: shipped for the default model, built once for others.

The default model's converted weights come from a pinned package, so the set built from the
default spec (concept_specs/default.yaml) is the same on every machine: the package carries it
(concept_specs/default.safetensors, ~540 KB) and a first start reads it instead of spending
minutes on the build. It serves a model only if both still hold: the model's fingerprint is
the one the shipped set was built for, and the spec (with the example files it names) is the
one it was built from (`spec_digest` in its provenance). Otherwise (any other model, or an
edited spec) the set is built once into the cache, named by the model's fingerprint and the
spec's digest, so a folder moved or renamed keeps its set and other weights of the same shape
never get it; the log says why and that the start waits for the build.
`tools/ship_default_concepts.py` rebuilds the shipped file after the spec or the conversion
changes; a test fails until it has been run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from salience.core.models.atomic import build_folder_once
from salience.core.models.folders import model_fingerprint
from salience.core.models.home import salience_home
from salience.core.probes.concepts import ConceptSet
from salience.core.serving.concept_spec import load_spec

__all__ = [
    "DEFAULT_SPEC",
    "SHIPPED",
    "build_default_concepts",
    "cache_folder",
    "default_concepts",
    "shipped_mismatch",
    "spec_digest",
]

log = logging.getLogger(__name__)

_SPECS = Path(__file__).resolve().parents[2] / "concept_specs"
DEFAULT_SPEC = _SPECS / "default.yaml"
SHIPPED = _SPECS / "default.safetensors"
_CACHED = "concepts.safetensors"  # the file in a set built into the cache
# Bump when a build reads or fits texts differently, so sets built the old way are not reused
# (2: texts read after the special tokens the tokenizer puts first, core/models/reading.py).
_BUILD = 2


def spec_digest(spec: dict[str, Any]) -> str:
    """Names a spec by its content, examples files read in: an edited spec is another spec."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:12]


def default_concepts(model: Path) -> Path:
    """The default concept set for `model`: the shipped file where it was built for this model and
    this spec, else one built once into the cache (a first start then takes minutes longer)."""
    spec = load_spec(DEFAULT_SPEC)
    digest = spec_digest(spec)
    why = shipped_mismatch(model, digest)
    if why is None:
        return SHIPPED
    target = cache_folder(model, spec)
    if not target.is_dir():
        log.info(
            "building the default concept set for %s once (%s); the start waits for it, --no-readouts skips it",
            model.name,
            why,
            extra={"folder": str(target)},
        )
    built = build_folder_once(target, lambda folder: build_default_concepts(model, folder / _CACHED))
    return built / _CACHED


def cache_folder(model: Path, spec: dict[str, Any]) -> Path:
    """Where the set `spec` builds for `model` is cached: named by the model's weights and the
    spec's content, never by the folder's path."""
    fingerprint = model_fingerprint(model)[:16]
    return salience_home() / "concepts" / f"{spec['name']}-{spec_digest(spec)}-{fingerprint}-b{_BUILD}"


def shipped_mismatch(model: Path, digest: str) -> str | None:
    """Why the shipped set cannot serve `model` under the spec of `digest`; None: it can."""
    if not SHIPPED.is_file():
        return f"the package has no {SHIPPED.name}"
    shipped = ConceptSet.load(SHIPPED)
    fingerprint = model_fingerprint(model)
    if shipped.model_fingerprint != fingerprint:
        return (
            f"the shipped set was built for the model {shipped.model_fingerprint[:12]}, this one is {fingerprint[:12]}"
        )
    if shipped.provenance.get("spec_digest") != digest:
        return f"the shipped set was built from another version of {DEFAULT_SPEC.name} (its examples changed)"
    return None


def build_default_concepts(model: Path, out: Path) -> None:
    """Build the default spec's set for `model` into `out`, its spec's digest in its provenance."""
    from salience.core.serving.concept_builder import build_concept_set

    spec = load_spec(DEFAULT_SPEC)
    built = asyncio.run(build_concept_set(spec, model, source=str(DEFAULT_SPEC)))
    provenance = {**built.provenance, "spec_digest": spec_digest(spec), "model": model.name}
    dataclasses.replace(built, provenance=provenance).save(out)
