"""Scorers and a metric over the readings a `salience/<model>` reply carries (provider.py).

A sample's reply has, per concept with a calibration, p that it has the concept: `running` (the
running view at its last token: the reply as a whole), `mean` and `max` (the token view over its
tokens), as the OpenAI extension's `summary` gives them. Those need readouts over the completion;
`monitor_fired` needs the monitor in the request.
"""

from __future__ import annotations

from typing import Any

from inspect_ai.model import ModelOutput
from inspect_ai.scorer import (
    CORRECT,
    INCORRECT,
    Metric,
    SampleScore,
    Score,
    Scorer,
    Target,
    accuracy,
    metric,
    scorer,
)
from inspect_ai.solver import TaskState

__all__ = ["VIEWS", "concept_means", "concept_score", "monitor_fired"]

VIEWS = ("running", "mean", "max")


@metric
def concept_means() -> Metric:
    """The mean p of each concept over the scored samples, from the scores' `metadata["p"]`."""

    def compute(scores: list[SampleScore]) -> dict[str, float]:
        per_concept: dict[str, list[float]] = {}
        for sample in scores:
            for concept, p in ((sample.score.metadata or {}).get("p") or {}).items():
                per_concept.setdefault(concept, []).append(p)
        return {concept: sum(ps) / len(ps) for concept, ps in sorted(per_concept.items())}

    return compute


@scorer(metrics=[accuracy(), concept_means()])
def concept_score(concept: str, threshold: float = 0.5, view: str = "running") -> Scorer:
    """CORRECT when the reply's p of `concept` (in `view`) is at least `threshold`.

    The score's `answer` is that p; its metadata holds every concept's p in the same view, which
    `concept_means` averages."""
    if view not in VIEWS:
        raise ValueError(f"concept_score: view must be one of {', '.join(VIEWS)}, got {view!r}")

    async def score(state: TaskState, target: Target) -> Score:
        summary = _readings(state.output, "summary", f"concept_score({concept!r}) needs readouts over the completion")
        if concept not in summary:
            raise ValueError(f"concept_score: no concept {concept!r} in the reply's summary: {', '.join(summary)}")
        if view not in summary[concept]:
            raise ValueError(f"concept_score: the summary has no {view!r} view in this readout format")
        p = summary[concept][view]
        return Score(
            value=CORRECT if p >= threshold else INCORRECT,
            answer=f"{p:.4f}",
            explanation=f"p({concept}, {view}) = {p:.4f} {'>=' if p >= threshold else '<'} {threshold}",
            metadata={"p": {name: read[view] for name, read in summary.items() if view in read}},
        )

    return score


@scorer(metrics=[accuracy()])
def monitor_fired(concept: str) -> Scorer:
    """CORRECT when a monitor on `concept` fired on the reply (a stop monitor's included)."""

    async def score(state: TaskState, target: Target) -> Score:
        events = _readings(state.output, "monitors", f"monitor_fired({concept!r}) needs a monitor on it")
        fired = [event for event in events if event.get("concept") == concept]
        where = ", ".join(f"token {event['index']} (p {event['probability']:.3f})" for event in fired)
        return Score(
            value=CORRECT if fired else INCORRECT,
            answer=str(len(fired)),
            explanation=f"{concept} fired at {where}" if fired else f"no monitor on {concept} fired",
        )

    return score


def _readings(output: ModelOutput, key: str, needs: str) -> Any:
    readings = (output.metadata or {}).get("salience") or {}
    if key not in readings:
        raise ValueError(f"{needs} (the reply's metadata.salience has no {key!r}); is the model salience/<name>?")
    return readings[key]
