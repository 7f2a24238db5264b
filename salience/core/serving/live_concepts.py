"""Defining, deleting and saving concepts on the running server: what every frontend calls.

A define from examples runs the concept builder's own fit (concept_builder.fit_concept) on
residuals the serving engine captures while it serves: each example text is one prefill-only
request asking for its raw residual rows (Engine.prefill `residual`), batched with live
traffic like any other request; the fit then runs in a thread, so streams keep streaming. The
engine publishes the concept only once its column is written (engine/live.py).

Changing what every client sees needs the `define` scope, which the frontends check before they
call here (salience/scopes.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from salience.core.engine.requests import Probes, ResidualRequest
from salience.core.models.reading import text_ids
from salience.core.probes import fitting
from salience.core.probes.live import check_name
from salience.core.serving.concept_builder import describe_concept, fit_concept, torch_threads
from salience.core.serving.concept_spec import MIN_EXAMPLES, SIDES
from salience.core.serving.status import ServerStatus
from salience.errors import ContextOverflow, InvalidArgument

__all__ = ["MAX_EXAMPLES", "ConceptDefinition", "define", "delete", "save"]

MAX_EXAMPLES = 256  # per class: the fit holds every text's residuals at every read layer in memory
VALIDATION = {"folds": 5, "seed": 0}  # as the builder's default
READ_BATCH = 16  # examples read at once: their prefills share engine steps


@dataclass(frozen=True, kw_only=True)
class ConceptDefinition:
    """A live concept as a client sends it: examples to fit, or vectors to use as given.

    `vectors` maps each read layer to float32 [hidden] bytes; `vector` is one such vector for
    every read layer. `layers` limits where the recommended layer is chosen (every read layer is
    fitted and calibrated: readouts cover them all)."""

    name: str
    positive: Sequence[str] = ()
    negative: Sequence[str] = ()
    method: str = "auto"
    layers: Sequence[int] | None = None
    vectors: Mapping[int, bytes] | None = None
    vector: bytes | None = None


async def define(status: ServerStatus, definition: ConceptDefinition, *, frontend: str) -> dict:
    """Define a live concept; the reply carries its concept_info, the builder's table for it, and
    the manifest version that first lists it."""
    engine = status.serving_engine()
    given = definition.vectors is not None or definition.vector is not None
    if given and (definition.positive or definition.negative):
        raise InvalidArgument("give examples (positive, negative) or vectors, not both")
    check_name(definition.name)
    with status.admit(frontend, "define_concept") as admitted:
        engine.live.reserve(definition.name)
        try:
            if given:
                vectors, info = _given_vectors(engine, definition), None
            else:
                vectors, info = await _fitted(engine, definition)
            view = await engine.live.define(definition.name, vectors, info)
        finally:
            engine.live.abandon(definition.name)  # a no-op once defined
        admitted.end("stop")
    return {
        "concept": definition.name,
        "version": view.version,
        "concept_info": view.info[view.concepts.index(definition.name)],
        "table": "\n".join(describe_concept(definition.name, info)),
    }


async def delete(status: ServerStatus, name: str) -> dict:
    view = status.serving_engine().live.delete(name)
    return {"concept": name, "deleted": True, "version": view.version}


def save(status: ServerStatus) -> bytes:
    """The served set plus every live concept, as a concept-set file's bytes (`--concepts` loads it)."""
    return status.serving_engine().live.served_set().to_bytes()


def _given_vectors(engine, definition: ConceptDefinition) -> dict[int, torch.Tensor]:
    layers = engine.live.table.loaded.layers
    raw = dict.fromkeys(layers, definition.vector) if definition.vector is not None else dict(definition.vectors or {})
    vectors = {}
    for layer, data in raw.items():
        if type(layer) is not int:
            raise InvalidArgument(f"vectors are keyed by layer index, got {layer!r}", field="vectors")
        if len(data) % 4:
            raise InvalidArgument(
                f"the vector at layer {layer} holds {len(data)} bytes, not float32 values",
                field="vector" if definition.vector is not None else "vectors",
            )
        vectors[layer] = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())
    return vectors  # checked (every read layer, size, finite, non-zero) by engine.live.define


async def _fitted(engine, definition: ConceptDefinition) -> tuple[dict[int, torch.Tensor], dict]:
    concept = _checked_examples(engine, definition)
    layers = list(engine.live.table.loaded.layers)
    candidates = _checked_layers(definition.layers, layers)
    texts = list(dict.fromkeys(t for side in SIDES for t in concept[side]))
    encoded = {text: text_ids(engine.tokenizer, text) for text in texts}
    # Each example's rows at every read layer, within what one request may hold.
    longest = min(engine.settings.max_residual_rows, engine.row_budget.rows) // len(layers) + 1
    for text, ids in encoded.items():
        if len(ids) < 2:
            raise InvalidArgument(f"example {text[:40]!r} is a single token; each example needs at least two")
        if len(ids) + 1 > engine.max_model_len:
            raise ContextOverflow(
                f"example {text[:40]!r}... is {len(ids)} tokens; this server's context is {engine.max_model_len}"
            )
        if len(ids) > longest:
            raise InvalidArgument(
                f"example {text[:40]!r}... is {len(ids)} tokens; a define reads each example at all "
                f"{len(layers)} read layers, which allows {longest} tokens per example (--max-residual-rows)"
            )
    residuals: dict[str, torch.Tensor] = {}

    async def read(text: str) -> None:
        ids = encoded[text]
        rows = ResidualRequest(layers=tuple(layers), ranges=((1, len(ids)),))
        scores = await engine.prefill(ids, probes=Probes(residual=rows))
        residuals[text] = torch.from_numpy(np.stack([scores.residuals[p] for p in range(1, len(ids))]))

    for start in range(0, len(texts), READ_BATCH):  # prefills batched in the engine, beside live traffic
        await asyncio.gather(*(read(text) for text in texts[start : start + READ_BATCH]))
    vectors, info = await asyncio.to_thread(
        _on_one_core,
        fit_concept,
        concept,
        layers,
        residuals,
        engine.settings.model,
        engine.tokenizer,
        VALIDATION,
        candidates=candidates,
    )
    return {layer: vectors[i] for i, layer in enumerate(layers)}, info


def _on_one_core(fit, *args, **kwargs):
    """Fit with one torch thread: the engine runs its steps on every core, and a fit's torch
    threads beside it (this process's, two on two cores) left 8 generating streams 11% of their
    throughput and made the define 6x as long (tools/bench_define.py). torch's thread count is the
    process's; this process runs no model, so nothing else here loses by it meanwhile."""
    with torch_threads(1):
        return fit(*args, **kwargs)


def _checked_examples(engine, definition: ConceptDefinition) -> dict:
    if definition.method not in ("auto", *fitting.METHODS):
        raise InvalidArgument(f"method must be auto, diff_means or logreg, got {definition.method!r}", field="method")
    concept = {"name": definition.name, "method": definition.method}
    for side in SIDES:
        texts = list(getattr(definition, side))
        if not all(isinstance(t, str) and t.strip() for t in texts):
            raise InvalidArgument(f"every {side} example must be a non-empty text", field=side)
        if not MIN_EXAMPLES <= len(texts) <= MAX_EXAMPLES:
            raise InvalidArgument(
                f"{len(texts)} {side} examples: a concept needs {MIN_EXAMPLES} to {MAX_EXAMPLES} of each", field=side
            )
        concept[side] = texts
    shared = set(concept["positive"]) & set(concept["negative"])
    if shared:
        raise InvalidArgument(f"example {next(iter(shared))[:40]!r} is both positive and negative")
    return concept


def _checked_layers(asked: Sequence[int] | None, layers: list[int]) -> list[int] | None:
    if asked is None:
        return None
    unknown = [layer for layer in asked if layer not in layers]
    if not asked or unknown:
        raise InvalidArgument(
            f"layers must name read layers ({layers[0]}..{layers[-1]}); {unknown or 'none'} "
            f"{'are' if len(unknown) != 1 else 'is'} not",
            field="layers",
        )
    return list(asked)
