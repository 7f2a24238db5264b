"""`salience concepts build` on the tiny model: every example text read at once through an engine
that only captures residual rows, the concepts fitted side by side; the set must be the builder's
own fit of transformers' residuals of the same texts, concept by concept in the spec's order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from salience.core.serving.concept_builder import build_concept_set, fit_concept
from salience.core.serving.concept_spec import background_for, load_spec
from tests.reference import Reference

LAYERS = [1, 3]  # some of the tiny model's four, the last among them


def _spec(folder: Path) -> dict:
    """Two concepts, the smaller first (fitted second: the largest starts first), and a background
    that shows one of them."""
    spec = {
        "name": "tiny-builder-test",
        "layers": LAYERS,
        "validation": {"folds": 4, "seed": 3},
        "background": "background.jsonl",
        "concepts": [
            {
                "name": "short",
                "positive": [f"alpha beta {i}" for i in range(6)],
                "negative": [f"one two {i * 3}" for i in range(6)],
                "method": "diff_means",
            },
            {
                "name": "long",
                "positive": [f"gamma delta {i} epsilon {i * 7} zeta eta theta iota" for i in range(10)],
                "negative": [f"three four five {i} six seven {i * 11} eight nine" for i in range(10)],
                "pairs": [[f"gamma delta {i} again", f"three four {i} again"] for i in range(3)],
            },
        ],
    }
    background = [
        {"text": f"ordinary words {i} and more {i * 5} of them", "shows": ["long"] if i % 3 == 0 else []}
        for i in range(9)
    ]
    (folder / "background.jsonl").write_text("".join(json.dumps(line) + "\n" for line in background))
    (folder / "spec.json").write_text(json.dumps(spec))
    return load_spec(folder / "spec.json")


@pytest.mark.parametrize("point", ["resid_post", "mlp_out"])
async def test_the_built_set_is_the_fit_of_the_references_residuals(
    tmp_path: Path, tiny_model: Path, tiny_reference: Reference, point: str
) -> None:
    """Fitted on the rows at `point` of each layer (mlp_out: what the MLP adds, read by a tap
    inside the layer rather than at its output), and reading there."""
    spec = {**_spec(tmp_path), "point": point}
    built = await build_concept_set(spec, tiny_model, source="spec.json")
    assert built.concepts == ("short", "long") and built.layers == tuple(LAYERS) and built.point == point
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = {t for c in spec["concepts"] for side in ("positive", "negative") for t in c[side]}
    texts |= {t for c in spec["concepts"] for pair in c["pairs"] for t in pair}
    texts |= {entry["text"] for entry in spec["background"]}
    residuals = {}
    for text in texts:
        by_layer = tiny_reference.residuals(tokenizer.encode(text, add_special_tokens=False), LAYERS, point)
        residuals[text] = torch.stack([by_layer[layer][1:] for layer in LAYERS], dim=1).float()
    for column, concept in enumerate(spec["concepts"]):
        background = background_for(spec, concept["name"])
        want, want_info = fit_concept(
            concept, LAYERS, residuals, tiny_model, tokenizer, spec["validation"], background=background
        )
        got_info = built.info[column]
        assert got_info["name"] == concept["name"] and got_info["n_background"] == len(background)
        assert got_info["method"] == want_info["method"]
        assert got_info["recommended_layer"] == want_info["recommended_layer"]
        for i, layer in enumerate(LAYERS):
            torch.testing.assert_close(built.vectors[layer][column], want[i], rtol=0, atol=1e-4)
        for got, ref in zip(got_info["layers"], want_info["layers"], strict=True):
            assert got["auroc"] == pytest.approx(ref["auroc"], abs=1e-6)
            assert got["token_auroc"] == pytest.approx(ref["token_auroc"], abs=1e-6)
            assert got["scale"] == pytest.approx(ref["scale"], rel=1e-3)
            assert got["running_scale"] == pytest.approx(ref["running_scale"], rel=1e-3)
