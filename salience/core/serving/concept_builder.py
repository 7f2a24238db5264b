"""Build a validated, calibrated concept set from contrastive example texts, through the vLLM engine.

Spec (JSON or YAML):

    name: my-concepts
    layers: all                # or a list of layer indices
    validation: {folds: 5, seed: 0}
    background: examples/background.jsonl  # optional: {"text": ..., "shows": [concepts], "source": ...}
    concepts:
      - name: french
        examples: examples/french.jsonl    # {"label": "positive"|"negative", "text": ..., "source": ...}
        positive: ["Le chat dort sur le canapé.", ...]     # inline lists work too, alone or beside a file
        negative: ["The cat sleeps on the sofa.", ...]
        pairs: [["Marie a faim.", "Mary is hungry."]]      # matched contrasts: [positive, negative]
        method: auto           # diff_means, logreg, or auto: the better held-out AUROC

An `examples` path is relative to the spec's folder; a line there may also be a matched pair,
{"positive": ..., "negative": ..., "source": ...}: two texts that differ only in the concept,
kept in one validation fold. Each concept needs at least MIN_EXAMPLES texts per class, and
concept_info warns below validation.FEW_EXAMPLES. The background's texts calibrate every concept
they do not show (`shows` names those they do) and measure its false positives; they never fit
a direction. How the directions and calibrations are fitted and validated is in probes/fitting.py and
probes/validation.py.

How a build runs (the default spec's 1,231 texts: about a minute on two cores, docs/benchmarks.md):

- Reading. The residuals come from the readout taps the server uses: an engine whose taps only
  capture residual rows (the same float32 state a readout projects, copied out before any
  projection), every text one prefill-only request, all of them submitted at once, so vLLM packs
  their prefills into full steps; the rows come back as arrays, never value by value.
- Fitting. Once the last text is read, the concepts are fitted side by side in threads, one per
  core, each on one torch thread, while the engine's processes end.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, ResidualRequest
from salience.core.engine.settings import EngineSettings
from salience.core.models import folders
from salience.core.models.folders import model_fingerprint, model_shape
from salience.core.models.points import Point
from salience.core.models.reading import text_ids
from salience.core.probes import fitting
from salience.core.probes.calibration import calibrated
from salience.core.probes.concepts import ConceptSet, capture_concepts
from salience.core.probes.validation import FEW_EXAMPLES, LayerFit, best_layer, folds
from salience.core.serving.concept_spec import SIDES, background_for
from salience.errors import InvalidArgument

__all__ = ["build_concept_set", "describe", "describe_concept", "fit_concept", "torch_threads"]

VIEWS = {
    "token": "p that this token belongs to a text with the concept: scale * raw + offset, per token",
    "running": "p that the text so far has the concept: running_scale * (mean raw over the tokens read so far, "
    "the first token of a text left out) + running_offset; on a text's last token, its score",
}
MAX_TEXT_TOKENS = 2048  # the reading engine's context: an example text's tokens, and one decode step
READ_MEMORY_MIB = 1024  # residual rows in flight: ~15K tokens at 30 layers of 576, several full steps


async def build_concept_set(spec: dict[str, Any], model: Path, *, source: str = "") -> ConceptSet:
    hidden, num_layers = model_shape(model)
    layers = list(range(num_layers)) if spec.get("layers", "all") == "all" else [int(x) for x in spec["layers"]]
    fingerprint = model_fingerprint(model)
    point = spec.get("point", "resid_post")  # where in each layer the rows are read and the set reads
    started = time.monotonic()
    engine = await Engine.start(_reading_settings(model, layers, point))
    try:
        residuals = await _read_residuals(engine, spec, layers)
        fitted = await _fit_concepts(spec, layers, residuals, model, engine.tokenizer, meanwhile=engine.shutdown)
    finally:
        engine.shutdown()  # safe twice: normally done once the fits are under way
    names = tuple(c["name"] for c in spec["concepts"])
    vectors = torch.stack([directions for directions, _ in fitted], 1)  # [layers, concepts, hidden]
    return ConceptSet(
        concepts=names,
        vectors={layer: vectors[i] for i, layer in enumerate(layers)},
        hidden_size=hidden,
        num_layers=num_layers,
        model_fingerprint=fingerprint,
        info=tuple(info for _, info in fitted),
        point=point,
        provenance={
            "method": "per concept: difference of class means or L2 logistic regression of per-text mean residuals "
            "(first token left out), unit-normalised, with token and running logistic calibrations per layer "
            "against the concept's negatives and the background (probes/fitting.py)",
            "spec": spec.get("name") or source,
            "examples": {
                c["name"]: [len(c["positive"]), len(c["negative"]), len(c["pairs"])] for c in spec["concepts"]
            },
            "background": len(spec.get("background") or ()),
            "model": str(model),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - started, 1),
        },
    )


async def _fit_concepts(
    spec: dict[str, Any],
    layers: list[int],
    residuals: Mapping[str, torch.Tensor],
    model: Path,
    tokenizer: Any,
    *,
    meanwhile: Callable[[], object],
) -> list[tuple[torch.Tensor, dict]]:
    """fit_concept of every concept, in spec order: concepts fitted side by side, one per core, the
    largest first, each on one torch thread (on torch's own two threads, one concept's fits took
    8-24x as long whenever another process took one of the two cores). `meanwhile` runs once they
    are under way."""
    validation = {"folds": 5, "seed": 0, **(spec.get("validation") or {})}
    concepts = spec["concepts"]
    loop = asyncio.get_running_loop()

    def rows(concept: dict[str, Any]) -> int:
        texts = [*concept["positive"], *concept["negative"], *(t for pair in concept["pairs"] for t in pair)]
        return sum(len(residuals[text]) for text in texts)

    with (
        tqdm(total=sum(fitting_steps(c, layers) for c in concepts), desc="fitting and validating", unit="fit") as bar,
        torch_threads(1),
        ThreadPoolExecutor(min(len(concepts), os.cpu_count() or 1)) as pool,
    ):

        def fit(concept: dict[str, Any]) -> tuple[torch.Tensor, dict]:
            background = background_for(spec, concept["name"])
            tick = functools.partial(loop.call_soon_threadsafe, bar.update)
            return fit_concept(
                concept, layers, residuals, model, tokenizer, validation, background=background, progress=tick
            )

        largest_first = sorted(range(len(concepts)), key=lambda i: rows(concepts[i]), reverse=True)
        futures = {i: loop.run_in_executor(pool, fit, concepts[i]) for i in largest_first}
        meanwhile()
        return list(await asyncio.gather(*(futures[i] for i in range(len(concepts)))))


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count (the process's) set to `n` for the body, and put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fitting_steps(concept: dict[str, Any], layers: Sequence[int]) -> int:
    return len(layers) * (2 if concept["method"] == "auto" else 1)


def fit_concept(
    concept: dict[str, Any],
    layers: Sequence[int],
    residuals: Mapping[str, torch.Tensor],
    model: Path,
    tokenizer: Any,
    validation: Mapping[str, Any],
    *,
    background: Sequence[str] = (),
    candidates: Sequence[int] | None = None,
    progress: Callable[[], object] = lambda: None,
) -> tuple[torch.Tensor, dict]:
    """One concept's directions [layers, hidden] (unit, float32) and its concept_info, from each
    text's residuals [tokens after the first, layers, hidden]: the concept's examples and pairs,
    and the `background` texts that calibrate it. The recommended layer is the best held-out one
    among `candidates` (default: every layer). `progress` ticks per fit."""
    layers = list(layers)
    norm, unembedding = folders.unembedding(model)
    pairs = concept.get("pairs") or []
    texts = [*concept["positive"], *concept["negative"], *(t for pair in pairs for t in pair), *background]
    labels = torch.tensor(
        [True] * len(concept["positive"]) + [False] * len(concept["negative"]) + [True, False] * len(pairs)
        + [False] * len(background)
    )  # fmt: skip
    pair_ids = torch.tensor(
        [-1] * (len(concept["positive"]) + len(concept["negative"]))
        + [i // 2 for i in range(2 * len(pairs))]
        + [-1] * len(background)
    )
    ordinary = torch.arange(len(texts)) >= len(texts) - len(background)
    per_class = min(int(labels.sum()), int((~labels & ~ordinary).sum()))
    fold = folds(
        labels,
        min(int(validation["folds"]), per_class),
        int(validation["seed"]),
        pairs=pair_ids,
        background=ordinary,
    )
    methods = fitting.METHODS if concept["method"] == "auto" else (concept["method"],)
    fits: dict[str, list[LayerFit]] = {method: [] for method in methods}
    directions: dict[str, list[torch.Tensor]] = {method: [] for method in methods}
    for i, layer in enumerate(layers):  # one layer's rows in float64 at a time
        data = _residuals_at(residuals, texts, labels, ordinary, i)
        for method in methods:
            fit, direction = fitting.validate(method, layer, data, fold)
            fits[method].append(fit)
            directions[method].append(direction)
            progress()
    allowed = set(candidates if candidates is not None else layers)

    def best(method: str) -> LayerFit:
        return best_layer([fit for fit in fits[method] if fit.layer in allowed])

    method = max(methods, key=lambda m: (best(m).auroc, m == "diff_means"))
    vectors = torch.stack(directions[method]).to(torch.float32)
    recommended = best(method).layer
    normed = folders.model_family(model).norm_scale(vectors[layers.index(recommended)], norm)
    raises, lowers = fitting.logit_lens(normed, unembedding)
    info = {
        "name": concept["name"],
        "recommended_layer": recommended,
        "method": method,
        "n_fit": len(texts) - len(background),
        "n_heldout": len(texts) - len(background),
        "n_positive": len(concept["positive"]) + len(pairs),
        "n_negative": len(concept["negative"]) + len(pairs),
        "n_pairs": len(pairs),
        "n_background": len(background),
        "validation": f"stratified {int(fold.max()) + 1}-fold, seed {validation['seed']}: every text "
        "held out once; the stored fit uses every text",
        "views": VIEWS,
        "method_auroc": {m: best(m).auroc for m in methods},
        "layers": [fit.as_dict() for fit in fits[method]],
        **few_examples(len(concept["positive"]) + len(pairs), len(concept["negative"]) + len(pairs)),
        # What the direction at the recommended layer writes: its logit lens.
        "writes": {
            "layer": recommended,
            "raises": [tokenizer.decode([t]) for t in raises],
            "lowers": [tokenizer.decode([t]) for t in lowers],
        },
    }
    return vectors, info


async def _read_residuals(engine: Engine, spec: dict[str, Any], layers: list[int]) -> dict[str, torch.Tensor]:
    """Each distinct example text's residuals [tokens after the first, layers, hidden] float32.
    Every text is submitted at once: vLLM packs their prefills into full steps, and the rows come
    back as arrays (the engine's residual rows), never value by value."""
    texts = list(
        dict.fromkeys(
            [
                *(t for c in spec["concepts"] for side in SIDES for t in c[side]),
                *(t for c in spec["concepts"] for pair in c["pairs"] for t in pair),
                *(entry["text"] for entry in spec.get("background") or ()),
            ]
        )
    )
    encoded = {text: text_ids(engine.tokenizer, text) for text in texts}
    for text, ids in encoded.items():
        if len(ids) < 2:
            raise InvalidArgument(f"example text {text!r} is a single token; it needs at least two")
    residuals = {}
    with tqdm(total=sum(map(len, encoded.values())), desc="reading example texts", unit="token") as bar:

        async def read(text: str) -> None:
            ids = encoded[text]
            asked = ResidualRequest(layers=tuple(layers), ranges=((1, len(ids)),))
            rows = (await engine.prefill(ids, probes=Probes(residual=asked))).residuals
            residuals[text] = torch.from_numpy(np.stack([rows[p] for p in range(1, len(ids))]))
            bar.update(len(ids))

        await asyncio.gather(*map(read, texts))
    return residuals


def _reading_settings(model: Path, layers: list[int], point: Point) -> EngineSettings:
    """An engine that only captures residual rows: taps at `point` of `layers` (the rows are copied out before
    any projection), no steering, no fair share, room for every example text's rows at every
    layer, and its processes forked from the fork server (`salience concepts build` starts it
    early)."""
    return EngineSettings(
        model=model,
        served_model_name="concept-builder",
        concepts=capture_concepts(model, layers, point),
        steering=False,
        spare_concepts=0,
        fair_share=False,
        max_model_len=MAX_TEXT_TOKENS,
        max_residual_rows=MAX_TEXT_TOKENS * len(layers),
        residual_memory_mib=READ_MEMORY_MIB,
        fork_server=True,
    )


def _residuals_at(
    residuals: Mapping[str, torch.Tensor], texts: list[str], labels: torch.Tensor, ordinary: torch.Tensor, i: int
) -> fitting.Residuals:
    blocks = [residuals[text][:, i] for text in texts]
    text = torch.repeat_interleave(torch.arange(len(texts)), torch.tensor([len(b) for b in blocks]))
    return fitting.Residuals(torch.cat(blocks).double(), text, labels, ordinary if ordinary.any() else None)


def few_examples(positive: int, negative: int) -> dict[str, str]:
    """concept_info's `warning` when either class is small enough that held-out figures prove little."""
    if min(positive, negative) >= FEW_EXAMPLES:
        return {}
    return {
        "warning": f"few examples ({positive} positive, {negative} negative; at least {FEW_EXAMPLES} "
        "of each are advised): the held-out figures are rough, read them with their intervals"
    }


def describe(concept_set: ConceptSet) -> str:
    """The set's manifest and provenance, then each concept's held-out figures layer by layer."""
    manifest = concept_set.manifest
    lines = [
        f"concepts: {', '.join(manifest.concepts)}",
        f"layers: {len(manifest.layers)} of {concept_set.num_layers} ({manifest.layers[0]}..{manifest.layers[-1]}), "
        f"hidden_size {manifest.hidden_size}, {manifest.dtype}, at {manifest.point}",
        f"model_fingerprint: {concept_set.model_fingerprint}",
        f"provenance: {json.dumps(concept_set.provenance, ensure_ascii=False)}",
    ]
    for name, info in zip(manifest.concepts, manifest.concept_info, strict=True):
        lines.append("")
        lines.extend(describe_concept(name, info))
    return "\n".join(lines)


def describe_concept(name: str, info: dict | None) -> list[str]:
    """One concept's method, logit lens and held-out figures layer by layer, as the builder prints them."""
    if not calibrated(info):
        return [f"{name}: not validated (no concept_info: a set built by hand, or a live concept given as vectors)"]
    lines = [
        f"{name}: method {info['method']}, recommended layer {info['recommended_layer']}, "
        f"{info['n_fit']} texts ({info['validation']})"
    ]
    if "n_positive" in info:
        lines.append(
            f"  examples: {info['n_positive']} positive, {info['n_negative']} negative ({info['n_pairs']} matched "
            f"pairs among them); background: {info['n_background'] or 'none'}"
        )
    if info.get("warning"):
        lines.append(f"  warning: {info['warning']}")
    if info.get("writes"):
        writes = info["writes"]
        lines.append(f"  writes (logit lens at layer {writes['layer']}):")
        lines.append(f"    raises: {' '.join(repr(t) for t in writes['raises'])}")
        lines.append(f"    lowers: {' '.join(repr(t) for t in writes['lowers'])}")
    lines.append("  layer  auroc (95% interval)   acc    bg_fpr (95% interval)  tok_auroc  run_tok_auroc  brier  ece")
    for fit in info["layers"]:
        mark = " <" if fit["layer"] == info["recommended_layer"] else ""
        lines.append(
            f"  {fit['layer']:>5}  {fit['auroc']:.3f} {_interval(fit.get('auroc_interval'))}  "
            f"{fit['accuracy']:.3f}  {_figure(fit.get('background_fpr'))} "
            f"{_interval(fit.get('background_fpr_interval'))}  {fit['token_auroc']:.3f}      "
            f"{_figure(fit.get('running_token_auroc'))}          {fit['brier']:.3f}  {fit['ece']:.3f}{mark}"
        )
    return lines


def _interval(bounds: Sequence[float] | None) -> str:
    return f"({bounds[0]:.3f}-{bounds[1]:.3f})" if bounds else " " * 13


def _figure(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "  -  "
