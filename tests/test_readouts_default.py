"""The built-in concept set on the default model: exact against transformers, and it means something."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from salience.cli import _default_concepts
from salience.core.concepts import ConceptSet
from salience.core.engine import Engine
from salience.core.types import SamplingOptions
from tests.conftest import start_engine
from tests.reference import Reference


@pytest.fixture(scope="module")
def concepts(default_model: Path) -> ConceptSet:
    concept_set = ConceptSet.load(_default_concepts(default_model))
    concept_set.check_model(default_model)
    return concept_set


@pytest_asyncio.fixture(scope="module")
async def engine(default_model: Path, concepts: ConceptSet) -> AsyncIterator[Engine]:
    engine = await start_engine(default_model, max_model_len=2048, concepts=concepts)
    yield engine
    engine.shutdown()


def test_default_set_has_recognisable_concepts(concepts: ConceptSet) -> None:
    assert len(concepts.concepts) >= 6 and len(concepts.layers) == 30
    for matrix in concepts.vectors.values():
        assert torch.allclose(matrix.norm(dim=1), torch.ones(len(concepts.concepts)), atol=1e-5)


async def test_readouts_match_reference_on_the_default_model(
    engine: Engine, concepts: ConceptSet, default_model: Path
) -> None:
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    generation = engine.generate(
        prompt, SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True), readout_ranges=[(0, 100)]
    )
    events = [e async for e in generation]
    ids = prompt + [e.token_id for e in events]
    residuals = Reference(default_model).residuals(ids, concepts.layers)
    want = torch.stack([residuals[layer] @ concepts.vectors[layer].double().T for layer in concepts.layers], dim=1)
    got = {**generation.prompt_readouts, **{e.position: e.readout for e in events if e.readout is not None}}
    assert sorted(got) == list(range(len(ids) - 1))
    for position, readout in got.items():
        row = want[position].reshape(-1)
        error = (torch.tensor(readout, dtype=torch.float64) - row).abs().max() / row.abs().max()
        assert float(error) < 1e-4, (position, float(error))


# Held-out texts (not in the spec), one pair per concept: the first should score higher.
PAIRS = {
    "french": (
        "Mon frère habite dans une petite maison près de la mer.",
        "My brother lives in a small house by the sea.",
    ),
    "positive_sentiment": (
        "This was a delightful evening with lovely friends.",
        "This was a miserable evening with awful people.",
    ),
    "code": ("while x < 10:\n    x += 1\n    print(x)", "Keep counting until you reach ten, saying each number."),
    "question": ("Do you know where the nearest pharmacy is?", "I know where the nearest pharmacy is."),
    "numbers": (
        "The flight departs at 14:35 from gate 27, row 12.",
        "The flight departs this afternoon from a gate nearby.",
    ),
    "names": ("Olivia Brown met Daniel Garcia in Madrid.", "A woman met a man in a big city."),
}


@pytest.mark.parametrize("concept", sorted(PAIRS))
async def test_texts_light_up_the_expected_concept(engine: Engine, concepts: ConceptSet, concept: str) -> None:
    index = concepts.concepts.index(concept)
    scores = []
    for text in PAIRS[concept]:
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
        readouts = await engine.readout(ids, [(0, len(ids))])
        values = torch.tensor([readouts[p] for p in range(len(ids))]).reshape(len(ids), len(concepts.layers), -1)
        # Mean over layers and tokens, leaving out the first token as the builder does:
        # its residual has a huge norm in every text (an attention sink).
        scores.append(float(values[1:, :, index].mean()))
    assert scores[0] > scores[1], scores
