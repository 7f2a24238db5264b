"""A concept spec as the builder reads it: its concepts' examples and matched pairs, and the
background, with every file it names read in and every field checked (the format is in
concept_builder's docstring)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from salience.core.models.points import POINTS
from salience.core.probes import fitting
from salience.errors import InvalidArgument

__all__ = ["MIN_EXAMPLES", "SIDES", "background_for", "load_spec"]

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
    if spec.get("point", "resid_post") not in POINTS:
        raise InvalidArgument(f"{path}: point {spec['point']!r} is not one of {', '.join(POINTS)}")
    if spec.get("background") is not None:
        spec["background"] = _background_file(path.parent / spec["background"])
    for i, concept in enumerate(spec["concepts"]):
        if not isinstance(concept, dict) or not isinstance(concept.get("name"), str):
            raise InvalidArgument(f"{path}: concept {i} needs a 'name'")
        name = concept["name"]
        pairs = concept.get("pairs") or []
        if not isinstance(pairs, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair) for pair in pairs
        ):
            raise InvalidArgument(f"{path}: concept {name!r}: 'pairs' is a list of [positive, negative] texts")
        concept["pairs"] = pairs
        if concept.get("examples") is not None:
            examples = _examples_file(path.parent / concept["examples"], name)
            concept["pairs"] = [*pairs, *examples.pop("pairs")]
            for side, texts in examples.items():
                concept[side] = [*(concept.get(side) or []), *texts]
        for side in SIDES:
            texts = concept.setdefault(side, [])
            if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
                raise InvalidArgument(f"{path}: concept {name!r} needs a '{side}' list of non-empty texts")
            if len(texts) + len(concept["pairs"]) < MIN_EXAMPLES:
                raise InvalidArgument(
                    f"{path}: concept {name!r} has {len(texts) + len(concept['pairs'])} {side} examples; "
                    f"it needs at least {MIN_EXAMPLES}"
                )
        method = concept.setdefault("method", "auto")
        if method not in ("auto", *fitting.METHODS):
            raise InvalidArgument(f"{path}: concept {name!r}: method {method!r} is not auto, diff_means or logreg")
    return spec


def _examples_file(path: Path, concept: str) -> dict[str, list]:
    """The file's single texts by side (`positive`, `negative`), and its matched `pairs`."""
    texts: dict[str, list] = {side: [] for side in (*SIDES, "pairs")}
    for number, example in _lines(path, f"concept {concept!r}"):
        try:
            if "label" in example:
                if example["label"] not in SIDES:
                    raise KeyError
                texts[example["label"]].append(_text(example["text"]))
            else:
                texts["pairs"].append([_text(example["positive"]), _text(example["negative"])])
        except (KeyError, TypeError):
            raise InvalidArgument(
                f'{path}:{number}: an example is {{"label": "positive" or "negative", "text": ...}} '
                'or a pair, {"positive": ..., "negative": ...}'
            ) from None
    return texts


def _background_file(path: Path) -> list[dict[str, Any]]:
    """The background's texts, each with the concepts it shows (which it must not calibrate)."""
    texts = []
    for number, example in _lines(path, "background"):
        shows = example.get("shows", [])
        try:
            text = _text(example["text"])
        except (KeyError, TypeError):
            text = None
        if text is None or not isinstance(shows, list) or not all(isinstance(c, str) for c in shows):
            raise InvalidArgument(f'{path}:{number}: a background text is {{"text": ..., "shows": [concept names]}}')
        texts.append({"text": text, "shows": shows})
    return texts


def _lines(path: Path, what: str):
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidArgument(f"{what}: cannot read examples {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            example = json.loads(line)
        except ValueError:
            example = None
        if not isinstance(example, dict):
            raise InvalidArgument(f"{path}:{number}: each line is one JSON object")
        yield number, example


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TypeError
    return value


def background_for(spec: Mapping[str, Any], concept: str) -> list[str]:
    """The spec's background texts that do not show `concept`."""
    return [entry["text"] for entry in spec.get("background") or () if concept not in entry["shows"]]
