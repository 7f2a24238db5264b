"""How a concept set reads texts no fit has seen: the held-out bar, on any model.

The texts are `tests/data/heldout/` (written for the tests, never in the spec, never used to
choose a layer). Each is read as a client reads it: tokenized as the model reads a prompt
(core/models/reading.py), the running view served over the whole text, its value at the last
token, at the concept's recommended layer. Per concept it prints the build's own held-out
figures (k-fold, concept_info) and, on these texts, the AUROC, the share on the right side of
0.5 (positives above, negatives below), the negatives below 0.5 (specificity), and the share of
held-out background texts that do not show the concept reading above 0.5. The bar the default
set meets on the default model: AUROC >= 0.95, specificity >= 0.90, >= 90% on the right side,
<= 10% of the background above 0.5.

    .venv/bin/python -m tools.heldout_concepts [--model DIR] [--concepts FILE] [--json PATH]

Without `--concepts`, the model's default set (shipped for the default model, else built once).
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `python tools/heldout_concepts.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.harness import Report, arguments, say

HELDOUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "heldout"
BAR = {"auroc": 0.95, "specificity": 0.90, "right": 0.90, "background": 0.10}


def heldout(name: str) -> list[dict]:
    """The held-out texts of `name` (a concept, or "background"), one dict per line."""
    lines = (HELDOUT / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@dataclass
class Reading:
    """One concept on the held-out texts."""

    concept: str
    layer: int
    method: str
    fold_auroc: float  # the build's own k-fold figure at the recommended layer
    auroc: float
    right: float
    specificity: float
    background: float
    positives: tuple[int, int]  # above 0.5, of
    negatives: tuple[int, int]  # below 0.5, of
    background_texts: int

    def meets(self) -> bool:
        return (
            self.auroc >= BAR["auroc"]
            and self.specificity >= BAR["specificity"]
            and self.right >= BAR["right"]
            and self.background <= BAR["background"]
        )


def reading(info: dict, scored: list[tuple[dict, float]], background: list[tuple[dict, float]]) -> Reading:
    """`info` (a concept_info entry) on its held-out texts' scores and the background's."""
    import torch

    from salience.core.probes import validation

    got = [(p, e["label"] == "positive") for e, p in scored]
    pos = [p > 0.5 for p, positive in got if positive]
    neg = [p <= 0.5 for p, positive in got if not positive]
    auroc = validation.auroc(torch.tensor([p for p, _ in got]), torch.tensor([b for _, b in got]))
    others = [p for e, p in background if info["name"] not in e["shows"]]
    best = next(f for f in info["layers"] if f["layer"] == info["recommended_layer"])
    return Reading(
        concept=info["name"],
        layer=info["recommended_layer"],
        method=info["method"],
        fold_auroc=best["auroc"],
        auroc=float(auroc),
        right=(sum(pos) + sum(neg)) / len(got),
        specificity=sum(neg) / len(neg),
        background=sum(p > 0.5 for p in others) / len(others),
        positives=(sum(pos), len(pos)),
        negatives=(sum(neg), len(neg)),
        background_texts=len(others),
    )


async def last_running_scores(engine, concept_set, texts: list[str]) -> list[dict[str, float]]:
    """Each text's running-view value at its last token, per concept at its recommended layer."""
    from salience.core.engine.requests import Probes
    from salience.core.models.reading import text_ids
    from salience.core.probes.calibration import ReadoutView

    width = len(concept_set.concepts)
    columns = {
        name: concept_set.layers.index(info["recommended_layer"]) * width + k
        for k, (name, info) in enumerate(zip(concept_set.concepts, concept_set.info, strict=True))
    }

    async def one(text: str) -> dict[str, float]:
        ids = text_ids(engine.tokenizer, text)
        # The running mean starts where a request reads: the whole text, as the page and REPL read it.
        probes = Probes(readout_ranges=[(0, len(ids))], readout_view=ReadoutView.RUNNING)
        last = (await engine.prefill(ids, probes=probes)).readouts[len(ids) - 1]
        return {name: float(last[column]) for name, column in columns.items()}

    return list(await asyncio.gather(*map(one, texts)))


def main() -> None:
    parser = arguments(__doc__, repeats=None)
    parser.add_argument("--model", type=Path, help="a model folder (default: the embedded default model)")
    parser.add_argument("--concepts", type=Path, help="a concept set (default: the model's default set)")
    args = parser.parse_args()

    from salience.core.models.default_model import ensure_default_model
    from salience.core.models.home import configure_environment
    from salience.core.probes.concepts import ConceptSet
    from salience.core.serving.default_concepts import default_concepts

    configure_environment()
    model = args.model or ensure_default_model()
    concept_set = ConceptSet.load(args.concepts or default_concepts(model))  # a build runs its own loop
    concept_set.check_model(model)
    asyncio.run(read_and_report(args, model, concept_set))


async def read_and_report(args, model: Path, concept_set) -> None:
    from salience.core.engine.engine import Engine
    from salience.core.engine.settings import EngineSettings

    say(f"reading the held-out texts on {model.name}")
    settings = EngineSettings(model=model, served_model_name=model.name, concepts=concept_set, max_model_len=2048)
    engine = await Engine.start(settings)
    try:
        background_entries = heldout("background")
        background_scores = await last_running_scores(engine, concept_set, [e["text"] for e in background_entries])
        readings = []
        for info in concept_set.info:
            entries = heldout(info["name"])
            scores = await last_running_scores(engine, concept_set, [e["text"] for e in entries])
            readings.append(
                reading(
                    info,
                    [(e, s[info["name"]]) for e, s in zip(entries, scores, strict=True)],
                    [(e, s[info["name"]]) for e, s in zip(background_entries, background_scores, strict=True)],
                )
            )
    finally:
        engine.shutdown()
    report = Report("heldout_concepts", args)
    table = report.table(
        f"{model.name}, {concept_set.provenance.get('spec', '')}: held-out texts (tests/data/heldout), "
        "running view at the last token, recommended layer",
        ("concept", "{}"),
        ("method", "{}"),
        ("layer", "{}"),
        ("k-fold AUROC", "{:.3f}"),
        ("AUROC", "{:.3f}"),
        ("right of 0.5", "{:.1%}"),
        ("positives above", "{}"),
        ("specificity", "{:.1%}"),
        ("background above 0.5", "{:.1%}"),
        ("meets the bar", "{}"),
    )
    for r in readings:
        table.add(
            r.concept,
            r.method,
            r.layer,
            r.fold_auroc,
            r.auroc,
            r.right,
            f"{r.positives[0]}/{r.positives[1]}",
            r.specificity,
            r.background,
            "yes" if r.meets() else "no",
        )
    report.text(f"{sum(r.meets() for r in readings)} of {len(readings)} concepts meet the bar ({BAR})")
    report.emit()


if __name__ == "__main__":
    main()
