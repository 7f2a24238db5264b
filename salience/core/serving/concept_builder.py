"""Build a validated, calibrated concept set from contrastive example texts, through the vLLM engine.

Spec (JSON or YAML):

    name: my-concepts
    layers: all                # or a list of layer indices
    validation: {folds: 5, seed: 0}
    concepts:
      - name: french
        examples: examples/french.jsonl    # {"label": "positive"|"negative", "text": ..., "source": ...}
        positive: ["Le chat dort sur le canapé.", ...]     # inline lists work too, alone or beside a file
        negative: ["The cat sleeps on the sofa.", ...]
        method: auto           # diff_means, logreg, or auto: the better held-out AUROC

An `examples` path is relative to the spec's folder. Each concept needs at least MIN_EXAMPLES
texts per class. The residuals come from the same readout taps the server uses, with identity
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
import yaml
from tqdm import tqdm

from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings
from salience.core.models import folders
from salience.core.models.folders import model_fingerprint, model_shape
from salience.core.probes import fitting
from salience.core.probes.calibration import calibrated
from salience.core.probes.concepts import ConceptSet
from salience.errors import InvalidArgument

__all__ = ["MIN_EXAMPLES", "SIDES", "build_concept_set", "describe", "describe_concept", "fit_concept", "load_spec"]

READ_BATCH = 16  # texts read at once: their prefills share engine steps
MIN_EXAMPLES = 4  # per class: k-fold validation needs both classes in every fit part
SIDES = ("positive", "negative")


def load_spec(path: Path) -> dict[str, Any]:
    """The spec with every concept's examples files read into its `positive` and `negative` lists."""
    try:
        spec = yaml.safe_load(path.read_text())  # JSON is YAML too
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"cannot read concept spec {path}: {exc}") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("concepts"), list) or not spec["concepts"]:
        raise InvalidArgument(f"{path}: a spec needs a non-empty 'concepts' list")
    for i, concept in enumerate(spec["concepts"]):
        if not isinstance(concept, dict) or not isinstance(concept.get("name"), str):
            raise InvalidArgument(f"{path}: concept {i} needs a 'name'")
        name = concept["name"]
        if concept.get("examples") is not None:
            for side, texts in _examples_file(path.parent / concept["examples"], name).items():
                concept[side] = [*(concept.get(side) or []), *texts]
        for side in SIDES:
            texts = concept.get(side)
            if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
                raise InvalidArgument(f"{path}: concept {name!r} needs a '{side}' list of non-empty texts")
            if len(texts) < MIN_EXAMPLES:
                raise InvalidArgument(
                    f"{path}: concept {name!r} has {len(texts)} {side} examples; it needs at least {MIN_EXAMPLES}"
                )
        method = concept.setdefault("method", "auto")
        if method not in ("auto", *fitting.METHODS):
            raise InvalidArgument(f"{path}: concept {name!r}: method {method!r} is not auto, diff_means or logreg")
    return spec


def _examples_file(path: Path, concept: str) -> dict[str, list[str]]:
    texts: dict[str, list[str]] = {side: [] for side in SIDES}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidArgument(f"concept {concept!r}: cannot read examples {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
            texts[example["label"]].append(example["text"])
        except (ValueError, KeyError, TypeError):
            raise InvalidArgument(
                f'{path}:{number}: an example is {{"label": "positive" or "negative", "text": ...}}'
            ) from None
    return texts


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
                concept, layers, residuals, model, tokenizer, validation, progress=progress.update
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
            "(first token left out), unit-normalised, with a logistic calibration per layer (probes/fitting.py)",
            "spec": spec.get("name") or source,
            "examples": {c["name"]: [len(c["positive"]), len(c["negative"])] for c in spec["concepts"]},
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
    candidates: Sequence[int] | None = None,
    progress: Callable[[], object] = lambda: None,
) -> tuple[torch.Tensor, dict]:
    """One concept's directions [layers, hidden] (unit, float32) and its concept_info, from each
    example text's residuals [tokens after the first, layers, hidden]. The recommended layer is
    the best held-out one among `candidates` (default: every layer). `progress` ticks per fit."""
    layers = list(layers)
    norm, unembedding = folders.unembedding(model)
    texts = [t for side in SIDES for t in concept[side]]
    labels = torch.tensor([side == "positive" for side in SIDES for _ in concept[side]])
    fold = fitting.folds(labels, min(int(validation["folds"]), len(concept["negative"])), int(validation["seed"]))
    per_layer = [_residuals_at(residuals, texts, labels, i) for i in range(len(layers))]
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
    vectors = torch.stack([fitting.fit_direction(method, per_layer[i]).to(torch.float32) for i in range(len(layers))])
    recommended = best(method).layer
    raises, lowers = fitting.logit_lens(vectors[layers.index(recommended)], norm, unembedding)
    info = {
        "name": concept["name"],
        "recommended_layer": recommended,
        "method": method,
        "n_fit": len(texts),
        "n_heldout": len(texts),
        "validation": f"stratified {int(fold.max()) + 1}-fold, seed {validation['seed']}: every text "
        "held out once; the stored fit uses every text",
        "method_auroc": {m: best(m).auroc for m in methods},
        "layers": [fit.as_dict() for fit in fits[method]],
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
    texts = list(dict.fromkeys(t for c in spec["concepts"] for side in SIDES for t in c[side]))
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


def _residuals_at(residuals: dict[str, torch.Tensor], texts: list[str], labels: torch.Tensor, i: int):
    blocks = [residuals[text][:, i].double() for text in texts]
    text = torch.repeat_interleave(torch.arange(len(texts)), torch.tensor([len(b) for b in blocks]))
    return fitting.Residuals(torch.cat(blocks), text, labels)


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
    if info.get("writes"):
        writes = info["writes"]
        lines.append(f"  writes (logit lens at layer {writes['layer']}):")
        lines.append(f"    raises: {' '.join(repr(t) for t in writes['raises'])}")
        lines.append(f"    lowers: {' '.join(repr(t) for t in writes['lowers'])}")
    lines.append("  layer  auroc  acc    tok_auroc  tok_acc  brier  ece    scale       offset")
    for fit in info["layers"]:
        mark = " <" if fit["layer"] == info["recommended_layer"] else ""
        lines.append(
            f"  {fit['layer']:>5}  {fit['auroc']:.3f}  {fit['accuracy']:.3f}  {fit['token_auroc']:.3f}      "
            f"{fit['token_accuracy']:.3f}    {fit['brier']:.3f}  {fit['ece']:.3f}  {fit['scale']:<+10.4g}  "
            f"{fit['offset']:<+10.4g}{mark}"
        )
    return lines
