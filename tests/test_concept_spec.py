"""The concept builder's spec (pairs, background) and its report (intervals, false positives,
warnings), without an engine: what `salience concepts build` reads and what `concepts show` and a
live define print."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from salience.core.serving.concept_builder import describe_concept, few_examples
from salience.core.serving.concept_spec import background_for, load_spec
from salience.errors import InvalidArgument

DEFAULT = Path(__file__).parent.parent / "salience" / "concept_specs" / "default.yaml"


def _write(folder: Path, name: str, lines: list[dict]) -> str:
    (folder / name).write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return name


def test_pairs_and_background_are_read_from_their_files(tmp_path: Path) -> None:
    examples = _write(
        tmp_path,
        "names.jsonl",
        [
            *({"label": "positive", "text": f"Ada Lovelace wrote note {i}."} for i in range(3)),
            *({"label": "negative", "text": f"The writer wrote note {i}."} for i in range(3)),
            {"positive": "Marie Curie won in Stockholm.", "negative": "The chemist won in the capital.", "source": "x"},
        ],
    )
    background = _write(
        tmp_path,
        "background.jsonl",
        [{"text": "Stir the soup slowly.", "shows": []}, {"text": "Paris is big.", "shows": ["names"]}],
    )
    spec = {"background": background, "concepts": [{"name": "names", "examples": examples}]}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    loaded = load_spec(tmp_path / "spec.yaml")
    concept = loaded["concepts"][0]
    assert concept["pairs"] == [["Marie Curie won in Stockholm.", "The chemist won in the capital."]]
    assert len(concept["positive"]) == len(concept["negative"]) == 3  # with the pair, 4 of each: enough
    assert background_for(loaded, "names") == ["Stir the soup slowly."]
    assert background_for(loaded, "code") == ["Stir the soup slowly.", "Paris is big."]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"label": "maybe", "text": "x y"}, 'an example is {"label": "positive" or "negative"'),
        ({"positive": "x y"}, "or a pair"),
        ({"positive": "x y", "negative": ""}, "or a pair"),
        ("not an object", "each line is one JSON object"),
    ],
)
def test_a_bad_example_line_names_its_file_and_line(tmp_path: Path, line: object, message: str) -> None:
    good = [{"label": side, "text": f"{side} text {i}"} for side in ("positive", "negative") for i in range(4)]
    _write(tmp_path, "c.jsonl", [*good, line])  # type: ignore[list-item]
    (tmp_path / "spec.yaml").write_text(json.dumps({"concepts": [{"name": "c", "examples": "c.jsonl"}]}))
    with pytest.raises(InvalidArgument, match=rf"c\.jsonl:9: .*{message}"):
        load_spec(tmp_path / "spec.yaml")


def test_a_bad_background_line_is_refused(tmp_path: Path) -> None:
    _write(tmp_path, "bg.jsonl", [{"text": "fine", "shows": []}, {"text": "shows what?", "shows": "code"}])
    spec = {"background": "bg.jsonl", "concepts": [{"name": "c", "positive": ["a b"] * 4, "negative": ["c d"] * 4}]}
    (tmp_path / "spec.yaml").write_text(json.dumps(spec))
    with pytest.raises(InvalidArgument, match=r"bg\.jsonl:2: a background text is"):
        load_spec(tmp_path / "spec.yaml")


def test_a_spec_names_a_point_of_the_layer_or_is_refused(tmp_path: Path) -> None:
    concept = {"name": "c", "positive": ["a b"] * 4, "negative": ["c d"] * 4}
    (tmp_path / "spec.yaml").write_text(json.dumps({"point": "attn_out", "concepts": [concept]}))
    assert load_spec(tmp_path / "spec.yaml")["point"] == "attn_out"
    (tmp_path / "spec.yaml").write_text(json.dumps({"point": "hook_z", "concepts": [concept]}))
    with pytest.raises(InvalidArgument, match=r"spec\.yaml: point 'hook_z' is not one of resid_pre, resid_mid, "):
        load_spec(tmp_path / "spec.yaml")


def test_the_default_spec_holds_its_background_and_pairs() -> None:
    spec = load_spec(DEFAULT)
    by_name = {c["name"]: c for c in spec["concepts"]}
    assert len(spec["background"]) >= 200 and len(by_name["names"]["pairs"]) >= 60
    for name, concept in by_name.items():
        assert len(concept["positive"]) + len(concept["pairs"]) >= 24, name
        assert len(background_for(spec, name)) >= 120, name


def test_the_report_gives_intervals_false_positives_and_a_warning() -> None:
    layer = {
        "layer": 3, "scale": 1.0, "offset": 0.0, "running_scale": 2.0, "running_offset": 0.1, "auroc": 1.0,
        "auroc_interval": [0.75, 1.0], "accuracy": 0.92, "token_auroc": 0.8, "token_accuracy": 0.7,
        "running_token_auroc": 0.9, "brier": 0.1, "ece": 0.05, "background_fpr": 0.125,
        "background_fpr_interval": [0.05, 0.2],
    }  # fmt: skip
    info = {
        "method": "diff_means", "recommended_layer": 3, "n_fit": 12, "validation": "5-fold", "n_positive": 6,
        "n_negative": 6, "n_pairs": 0, "n_background": 0, "layers": [layer], **few_examples(6, 6),
    }  # fmt: skip
    lines = describe_concept("mine", info)
    assert "few examples (6 positive, 6 negative; at least 24 of each are advised)" in lines[2]
    row = lines[-1].split()
    assert row[:5] == ["3", "1.000", "(0.750-1.000)", "0.920", "0.125"] and row[5] == "(0.050-0.200)"
    assert row[6:8] == ["0.800", "0.900"] and row[-1] == "<"
    assert few_examples(24, 30) == {}
