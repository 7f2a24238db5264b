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
concept_info warns below fitting.FEW_EXAMPLES. The background's texts calibrate every concept
they do not show (`shows` names those they do) and measure its false positives; they never fit
a direction. The residuals come from the same readout taps the server uses, with identity
matrices as "concepts", so the builder measures exactly what serving will project; how the
directions and calibrations are fitted and validated is in probes/fitting.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings
from salience.core.models import folders
from salience.core.models.folders import model_fingerprint, model_shape
from salience.core.probes import fitting
from salience.core.probes.calibration import calibrated
from salience.core.probes.concepts import ConceptSet
from salience.core.serving.concept_spec import SIDES, background_for
from salience.errors import InvalidArgument

__all__ = ["build_concept_set", "describe", "describe_concept", "fit_concept"]

VIEWS = {
    "token": "p that this token belongs to a text with the concept: scale * raw + offset, per token",
    "running": "p that the text so far has the concept: running_scale * (mean raw over the tokens read so far, "
    "the first token of a text left out) + running_offset; on a text's last token, its score",
}
READ_BATCH = 16  # texts read at once: their prefills share engine steps


async def build_concept_set(spec: dict[str, Any], model: Path, *, source: str = "") -> ConceptSet:
    hidden, num_layers = model_shape(model)
    layers = list(range(num_layers)) if spec.get("layers", "all") == "all" else [int(x) for x in spec["layers"]]
    fingerprint = model_fingerprint(model)
    started = time.monotonic()
    residuals, tokenizer = await _read_residuals(spec, model, layers, hidden, fingerprint, num_layers)
    validation = {"folds": 5, "seed": 0, **(spec.get("validation") or {})}
    names = tuple(c["name"] for c in spec["concepts"])
    vectors = torch.zeros(len(layers), len(names), hidden, dtype=torch.float32)
    info = []
    steps = sum(fitting_steps(c, layers) for c in spec["concepts"])
    with tqdm(total=steps, desc="fitting and validating", unit="layer") as progress:
        for column, concept in enumerate(spec["concepts"]):
            fitted, concept_info = fit_concept(
                concept,
                layers,
                residuals,
                model,
                tokenizer,
                validation,
                background=background_for(spec, concept["name"]),
                progress=progress.update,
            )
            vectors[:, column] = fitted
            info.append(concept_info)
    return ConceptSet(
        concepts=names,
        vectors={layer: vectors[i] for i, layer in enumerate(layers)},
        hidden_size=hidden,
        num_layers=num_layers,
        model_fingerprint=fingerprint,
        info=tuple(info),
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
    fold = fitting.folds(
        labels,
        min(int(validation["folds"]), per_class),
        int(validation["seed"]),
        pairs=pair_ids,
        background=ordinary,
    )
    per_layer = [_residuals_at(residuals, texts, labels, ordinary, i) for i in range(len(layers))]
    methods = fitting.METHODS if concept["method"] == "auto" else (concept["method"],)
    fits: dict[str, list[fitting.LayerFit]] = {}
    for method in methods:
        fits[method] = []
        for i, layer in enumerate(layers):
            fits[method].append(fitting.cross_validate(method, layer, per_layer[i], fold))
            progress()
    allowed = set(candidates if candidates is not None else layers)

    def best(method: str) -> fitting.LayerFit:
        return fitting.best_layer([fit for fit in fits[method] if fit.layer in allowed])

    method = max(methods, key=lambda m: (best(m).auroc, m == "diff_means"))
    vectors = torch.stack(
        [fitting.fit_direction(method, per_layer[i].examples()).to(torch.float32) for i in range(len(layers))]
    )
    recommended = best(method).layer
    raises, lowers = fitting.logit_lens(vectors[layers.index(recommended)], norm, unembedding)
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


async def _read_residuals(
    spec: dict[str, Any], model: Path, layers: list[int], hidden: int, fingerprint: str, num_layers: int
) -> tuple[dict[str, torch.Tensor], Any]:
    """Each distinct example text's residuals [tokens after the first, layers, hidden] float32, and
    the model's tokenizer."""
    identity = ConceptSet(
        concepts=tuple(f"d{i}" for i in range(hidden)),
        vectors={layer: torch.eye(hidden) for layer in layers},
        hidden_size=hidden,
        num_layers=num_layers,
        model_fingerprint=fingerprint,
    )
    engine = await Engine.start(
        EngineSettings(model=model, served_model_name="concept-builder", concepts=identity, max_model_len=2048)
    )
    texts = list(
        dict.fromkeys(
            [
                *(t for c in spec["concepts"] for side in SIDES for t in c[side]),
                *(t for c in spec["concepts"] for pair in c["pairs"] for t in pair),
                *(entry["text"] for entry in spec.get("background") or ()),
            ]
        )
    )
    encoded = {text: engine.tokenizer.encode(text, add_special_tokens=False) for text in texts}
    for text, ids in encoded.items():
        if len(ids) < 2:
            raise InvalidArgument(f"example text {text!r} is a single token; it needs at least two")
    residuals = {}
    progress = tqdm(total=len(texts), desc="reading example texts", unit="text")

    async def read(text: str) -> None:
        ids = encoded[text]
        readouts = await engine.readout(ids, [(1, len(ids))])
        rows = torch.tensor([readouts[p] for p in range(1, len(ids))], dtype=torch.float32)
        residuals[text] = rows.reshape(len(ids) - 1, len(layers), hidden)
        progress.update()

    try:
        for start in range(0, len(texts), READ_BATCH):  # prefills batched in the engine
            await asyncio.gather(*(read(text) for text in texts[start : start + READ_BATCH]))
    finally:
        progress.close()
        engine.shutdown()
    return residuals, engine.tokenizer


def _residuals_at(
    residuals: Mapping[str, torch.Tensor], texts: list[str], labels: torch.Tensor, ordinary: torch.Tensor, i: int
) -> fitting.Residuals:
    blocks = [residuals[text][:, i].double() for text in texts]
    text = torch.repeat_interleave(torch.arange(len(texts)), torch.tensor([len(b) for b in blocks]))
    return fitting.Residuals(torch.cat(blocks), text, labels, ordinary if ordinary.any() else None)


def few_examples(positive: int, negative: int) -> dict[str, str]:
    """concept_info's `warning` when either class is small enough that held-out figures prove little."""
    if min(positive, negative) >= fitting.FEW_EXAMPLES:
        return {}
    return {
        "warning": f"few examples ({positive} positive, {negative} negative; at least {fitting.FEW_EXAMPLES} "
        "of each are advised): the held-out figures are rough, read them with their intervals"
    }


def describe(concept_set: ConceptSet) -> str:
    """The set's manifest and provenance, then each concept's held-out figures layer by layer."""
    manifest = concept_set.manifest
    lines = [
        f"concepts: {', '.join(manifest.concepts)}",
        f"layers: {len(manifest.layers)} of {concept_set.num_layers} ({manifest.layers[0]}..{manifest.layers[-1]}), "
        f"hidden_size {manifest.hidden_size}, {manifest.dtype}",
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
