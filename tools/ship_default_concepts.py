"""Rebuild the default concept set the package ships (salience/concept_specs/default.safetensors).

Run after the default spec, its example files or the default model's conversion change:
tests/test_default_concepts.py fails until the shipped file matches them again, and until then
every first start builds the set itself (salience/core/serving/default_concepts.py).

    .venv/bin/python -m tools.ship_default_concepts
"""

from __future__ import annotations

import sys

from salience.core.models.home import configure_environment


def main() -> int:
    configure_environment()  # before anything imports vllm or torch
    from salience.core.models.default_model import ensure_default_model
    from salience.core.probes.concepts import ConceptSet
    from salience.core.serving.default_concepts import SHIPPED, build_default_concepts
    from salience.logs import setup_logging

    setup_logging("info")
    scratch = SHIPPED.with_suffix(".tmp")
    build_default_concepts(ensure_default_model(), scratch)
    scratch.chmod(0o644)  # safetensors writes 0600; every user of an installed package reads it
    scratch.rename(SHIPPED)
    shipped = ConceptSet.load(SHIPPED)
    size, layers = SHIPPED.stat().st_size, len(shipped.layers)
    print(f"wrote {SHIPPED} ({size} bytes): {len(shipped.concepts)} concepts at {layers} layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
