"""Steering the default model along its built-in concepts: exact against transformers, and it does
what a person expects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from salience.core.engine.engine import Engine
from salience.core.engine.requests import SamplingOptions
from salience.core.probes.concepts import ConceptSet
from tests.reference import Reference
from tests.steer_reference import check_against_reference
from tests.test_steering import run as steered_run
from tests.test_steering import steer

# Position 0 is the attention sink (a residual thousands of times larger than the rest): leave it be.
AFTER_SINK = ((1, 10_000),)


@pytest.fixture(scope="module")
def concepts(default_concepts: ConceptSet) -> ConceptSet:
    return default_concepts


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    # Compiled, as `salience serve` runs it; the eager path is proven on the tiny model.
    return default_engine


@pytest.fixture(scope="module")
def reference(default_model: Path) -> Reference:
    return Reference(default_model)


GREEDY = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)


async def run(engine: Engine, text: str, interventions, n: int = GREEDY.max_tokens):
    """`text` and n greedy tokens under `interventions`, read at every position: the prompt, the events
    and the readouts by position."""
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    generation, events = await steered_run(engine, prompt, interventions, dataclasses.replace(GREEDY, max_tokens=n))
    readouts = {**generation.prompt_readouts, **{e.position: e.readout for e in events}}
    assert len(events) == n and sorted(readouts) == list(range(len(prompt) + n))
    return prompt, events, readouts


CASES = {
    "add at two layers, prompt and decode": [
        steer("positive_sentiment", 5, "add", 12.0, ranges=AFTER_SINK),
        steer("question", 22, "add", -20.0, ranges=AFTER_SINK),
    ],
    "set on the prompt, ablate while decoding": [
        steer("code", 10, "set", 15.0, ranges=((1, 9),)),
        steer("french", 20, "ablate", generated=True),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
async def test_matches_reference(engine: Engine, reference: Reference, concepts: ConceptSet, case: str) -> None:
    interventions = CASES[case]
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    generation, events = await steered_run(engine, prompt, interventions, GREEDY)
    check_against_reference(reference, concepts, prompt, interventions, GREEDY, generation, events)


def french(concepts: ConceptSet, readout, layer: int) -> float:
    return readout[concepts.layers.index(layer) * len(concepts.concepts) + concepts.concepts.index("french")]


async def test_adding_french_at_a_middle_layer_makes_the_model_french(engine: Engine, concepts: ConceptSet) -> None:
    text = "My favourite food is"
    prompt, plain, plain_readouts = await run(engine, text, (), n=16)
    # Measured on the default set's french direction: +64 at layer 12 turns the answer French
    # (" la Croque, le livre, au chocolat, et ..."); at 15 it needs about +96 (docs/steering.md).
    interventions = [steer("french", 12, "add", 64.0, ranges=AFTER_SINK)]
    _, events, readouts = await run(engine, text, interventions, n=16)

    def mean_french(rows: dict, layer: int) -> float:
        return sum(french(concepts, rows[p], layer) for p in rows if p > 0) / (len(rows) - 1)

    # The french readout at layer 12 moves by exactly alpha (it reports the steered residual) ...
    at_12 = [french(concepts, readouts[p], 12) - french(concepts, plain_readouts[p], 12) for p in range(1, len(prompt))]
    assert at_12 == pytest.approx([64.0] * len(at_12), abs=1e-2)
    # ... and the model carries it to the last layer, far beyond what it had there.
    assert mean_french(readouts, 29) > mean_french(plain_readouts, 29) + 100
    decode = engine.tokenizer.decode
    steered_text, plain_text = decode([e.token_id for e in events]), decode([e.token_id for e in plain])
    assert steered_text != plain_text
    assert any(word in f" {steered_text} " for word in (" la ", " le ", " La ", " Le ", " de ", " et "))
    assert not any(word in f" {plain_text} " for word in (" la ", " le ", " La ", " Le ", " de ", " et "))


async def test_ablating_french_sends_its_later_readouts_toward_zero(engine: Engine, concepts: ConceptSet) -> None:
    """Ablated at one layer, the concept is gone there and much weaker in the three layers right after
    (under half; the direction fitted with other-language negatives is back to 0.53 of itself by layer
    16); the model rebuilds it further up (back by about layer 21 on French text), so removing it for
    good means ablating at every layer from there on."""
    text = "Le chat dort sur le canapé et"
    _, plain_events, plain = await run(engine, text, ())
    _, _, once = await run(engine, text, [steer("french", 12, "ablate", ranges=AFTER_SINK)])
    _, events, everywhere = await run(engine, text, [steer("french", range(12, 30), "ablate", ranges=AFTER_SINK)])
    positions = [p for p in plain if p > 0]

    def magnitude(rows: dict, layer: int) -> float:
        return sum(abs(french(concepts, rows[p], layer)) for p in positions) / len(positions)

    assert magnitude(once, 12) < 1e-3
    for layer in range(13, 16):
        assert magnitude(once, layer) < 0.5 * magnitude(plain, layer), layer
    assert all(magnitude(everywhere, layer) < 1e-3 for layer in range(12, 30))
    assert min(magnitude(plain, layer) for layer in range(12, 30)) > 5  # measured 8.6 at its weakest layer
    assert [e.token_id for e in events] != [e.token_id for e in plain_events]
