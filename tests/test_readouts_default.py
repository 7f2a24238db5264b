"""The built-in concept set on the default model: exact against transformers, and it means something."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.models.reading import text_ids
from salience.core.probes import validation
from salience.core.probes.calibration import ReadoutView
from salience.core.probes.concepts import ConceptSet
from tests.conftest import start_engine
from tests.reference import Reference, assert_readouts_close, probabilities, reference_readouts
from tools.heldout_concepts import heldout  # texts written for the tests, never in the spec or the fit


@pytest.fixture(scope="module")
def concepts(default_concepts: ConceptSet) -> ConceptSet:
    return default_concepts


@pytest.fixture(scope="module")
def engine(default_engine: Engine) -> Engine:
    # Compiled, as `salience serve` runs it by default; the eager path is proven on the tiny model.
    return default_engine


def test_default_set_has_recognisable_concepts(concepts: ConceptSet) -> None:
    assert len(concepts.concepts) >= 6 and len(concepts.layers) == 30
    for matrix in concepts.vectors.values():
        assert torch.allclose(matrix.norm(dim=1), torch.ones(len(concepts.concepts)), atol=1e-5)


async def test_readouts_match_reference_on_the_default_model(
    engine: Engine, concepts: ConceptSet, reference: Reference
) -> None:
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    generation = engine.generate(
        prompt,
        SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True),
        probes=Probes(readout_ranges=[(0, 100)]),
    )
    events = [e async for e in generation]
    ids = prompt + [e.token_id for e in events]
    got = {**generation.prompt_readouts, **{e.position: e.readout for e in events if e.readout is not None}}
    assert sorted(got) == list(range(len(prompt) + 6))
    assert_matches(got, ids, reference, concepts)


@pytest.fixture(scope="module")
def reference(default_model: Path) -> Reference:
    return Reference(default_model)


def assert_matches(readouts: dict, ids: list[int], reference: Reference, concepts: ConceptSet) -> None:
    want = reference_readouts(reference, concepts, ids)
    assert_readouts_close(readouts, want)


async def test_eight_concurrent_requests_and_a_prefix_cache_hit(
    engine: Engine, concepts: ConceptSet, reference: Reference
) -> None:
    texts = [
        f"Story {i}: once upon a time a {animal} lived by the river."
        for i, animal in enumerate(["fox", "cat", "owl", "bear", "frog", "wolf", "hare", "duck"])
    ]
    prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    options = SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def run(i: int):
        ranges = [(i % 3, 6 + i), (len(prompts[i]) + 1, len(prompts[i]) + 3)]
        generation = engine.generate(prompts[i], options, probes=Probes(readout_ranges=ranges))
        events = [e async for e in generation]
        return generation, events

    results = await asyncio.gather(*(run(i) for i in range(8)))
    for i, (generation, events) in enumerate(results):
        ids = prompts[i] + [e.token_id for e in events]
        readouts = {**generation.prompt_readouts, **{e.position: e.readout for e in events if e.readout}}
        assert sorted(readouts) == [*range(i % 3, 6 + i), len(prompts[i]) + 1, len(prompts[i]) + 2]
        assert_matches(readouts, ids, reference, concepts)

    long = engine.tokenizer.encode(" ".join(texts * 6), add_special_tokens=False)
    [e async for e in engine.generate(long, options)]
    cached = engine.generate(long, options)
    [e async for e in cached]
    assert cached.cached_tokens >= 128
    hit = engine.generate(long, options, probes=Probes(readout_ranges=[(0, len(long))]))
    [e async for e in hit]
    assert sorted(hit.prompt_readouts) == list(range(len(long)))
    assert_matches({p: hit.prompt_readouts[p] for p in (0, 127, 128, len(long) - 1)}, long, reference, concepts)


async def test_chunked_prefill_on_the_default_model(
    default_model: Path, concepts: ConceptSet, reference: Reference
) -> None:
    chunked = await start_engine(
        default_model,
        max_model_len=1024,
        concepts=concepts,
        engine_args={"enable_chunked_prefill": True, "max_num_batched_tokens": 32},
    )
    try:
        prompt = chunked.tokenizer.encode("Chunked prefill splits this prompt. " * 8, add_special_tokens=False)
        assert len(prompt) > 64
        generation = chunked.generate(
            prompt,
            SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True),
            probes=Probes(readout_ranges=[(0, 200)]),
        )
        events = [e async for e in generation]
        ids = prompt + [e.token_id for e in events]
        readouts = {**generation.prompt_readouts, **{e.position: e.readout for e in events if e.readout}}
        assert sorted(readouts) == list(range(len(prompt) + 3))
        assert_matches(readouts, ids, reference, concepts)
    finally:
        chunked.shutdown()


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


async def text_scores(engine: Engine, concepts: ConceptSet, text: str) -> dict[str, float]:
    """A text's score for every concept, as a client reads it: the running view at its last token,
    at each concept's recommended layer, served over the whole text (position 0 is never counted).
    The whole last row is checked against the manifest's running maps of the raw rows, as a client
    would apply them."""
    ids = text_ids(engine.tokenizer, text)  # as builds read their texts and tools/heldout_concepts scores them
    served = await engine.prefill(ids, probes=Probes(readout_ranges=[(0, len(ids))], readout_view=ReadoutView.RUNNING))
    raw = await engine.readout(ids, [(1, len(ids))])
    rows = torch.tensor([raw[p] for p in range(1, len(ids))], dtype=torch.float64)
    assert all(value is None for value in served.readouts[0])
    last = torch.tensor(served.readouts[len(ids) - 1], dtype=torch.float64)
    # The raw rows come from a second request, which the engine may batch with another text's
    # while the first ran alone (all_scores runs texts side by side): float32 products of other
    # shapes differ in the last bits, up to ~2e-7 in a probability (seen in the full suite).
    assert torch.allclose(last, probabilities(concepts, rows, "running")[-1], rtol=0, atol=1e-6)
    width = len(concepts.concepts)
    return {
        name: float(last[concepts.layers.index(info["recommended_layer"]) * width + k])
        for k, (name, info) in enumerate(zip(concepts.concepts, concepts.info, strict=True))
    }


async def all_scores(engine: Engine, concepts: ConceptSet, texts: list[str]) -> list[dict[str, float]]:
    """text_scores of each text, all at once (the engine batches them)."""
    return list(await asyncio.gather(*(text_scores(engine, concepts, text) for text in texts)))


@pytest.mark.parametrize("concept", sorted(PAIRS))
async def test_texts_light_up_the_expected_concept(engine: Engine, concepts: ConceptSet, concept: str) -> None:
    present, absent = [scores[concept] for scores in await all_scores(engine, concepts, list(PAIRS[concept]))]
    # Minimal pairs: "A woman met a man..." reads people but no name; "I know where..." has a
    # wh-word but asks nothing. The matched contrasts and near misses of the spec put them below.
    assert present > 0.5 > absent, (present, absent)


@pytest_asyncio.fixture(scope="module")
async def heldout_scores(engine: Engine, concepts: ConceptSet) -> dict[str, list[tuple[dict, float]]]:
    """Per concept, each held-out text (its line) with its score for that concept."""
    scores = {}
    for name in concepts.concepts:
        entries = heldout(name)
        texts = await all_scores(engine, concepts, [e["text"] for e in entries])
        scores[name] = [(e, text[name]) for e, text in zip(entries, texts, strict=True)]
    header = f"{'concept':<20} {'layer':>5} {'method':<10} {'auroc':>6} {'right of 0.5':>13}  {'pos':>7} {'neg':>7}"
    print("\nheld-out texts (tests/data/heldout), default set\n" + header)
    for name, info in zip(concepts.concepts, concepts.info, strict=True):
        got = [(p, e["label"] == "positive") for e, p in scores[name]]
        right = [(p > 0.5) == positive for p, positive in got]
        pos = [r for r, (_, positive) in zip(right, got, strict=True) if positive]
        neg = [r for r, (_, positive) in zip(right, got, strict=True) if not positive]
        auroc = validation.auroc(torch.tensor([p for p, _ in got]), torch.tensor([b for _, b in got]))
        print(
            f"{name:<20} {info['recommended_layer']:>5} {info['method']:<10} {auroc:>6.3f} "
            f"{sum(right) / len(right):>13.3f}  {sum(pos):>3}/{len(pos):<3} {sum(neg):>3}/{len(neg):<3}"
        )
    return scores


@pytest_asyncio.fixture(scope="module")
async def background_scores(engine: Engine, concepts: ConceptSet) -> list[tuple[dict, dict[str, float]]]:
    """Each held-out background text (tests/data/heldout/background.jsonl) with its scores."""
    entries = heldout("background")
    return list(zip(entries, await all_scores(engine, concepts, [e["text"] for e in entries]), strict=True))


def test_the_default_set_is_validated_and_calibrated(concepts: ConceptSet) -> None:
    for name, info in zip(concepts.concepts, concepts.info, strict=True):
        assert info["name"] == name and info["n_fit"] >= 96 and "warning" not in info, info
        assert min(info["n_positive"], info["n_negative"]) >= 24 and info["n_background"] >= 120, info
        best = next(f for f in info["layers"] if f["layer"] == info["recommended_layer"])
        assert best["auroc"] >= 0.95, (name, best)  # held out, per text (k-fold)
        assert best["background_fpr"] <= 0.1, (name, best)  # held-out background texts above 0.5
        low, high = best["auroc_interval"]
        assert low <= best["auroc"] <= high and high - low < 0.1, (name, best)
        assert [f["layer"] for f in info["layers"]] == list(concepts.layers)


@pytest.mark.parametrize("concept", ["positive_sentiment", "french", "code", "question", "numbers", "names"])
def test_held_out_texts_fall_on_their_side_of_one_half(heldout_scores: dict, concept: str) -> None:
    got = [(p, e["label"] == "positive") for e, p in heldout_scores[concept]]
    assert sum(positive for _, positive in got) >= 20 and sum(not positive for _, positive in got) >= 20
    right = sum((p > 0.5) == positive for p, positive in got)
    assert right >= 0.9 * len(got), f"{concept}: {right} of {len(got)} on the right side of 0.5"


@pytest.mark.parametrize("concept", ["positive_sentiment", "french", "code", "question", "numbers", "names"])
def test_ordinary_text_reads_below_one_half(background_scores: list, concept: str) -> None:
    """Held-out background texts that do not show the concept: at most 10% score above 0.5."""
    texts = [(e["text"], scores[concept]) for e, scores in background_scores if concept not in e["shows"]]
    above = [text for text, p in texts if p > 0.5]
    assert len(texts) >= 40 and len(above) <= 0.1 * len(texts), (concept, above)


def test_an_unnamed_person_is_not_a_name(heldout_scores: dict) -> None:
    """Held-out matched pairs for names: the sentence with a common description in place of each
    proper name reads below 0.5, and below its named side, in at least 90% of the pairs. (That the
    named side reads above 0.5 is the held-out texts' test: a single name in a long sentence is
    the hard case, diluted by the mean.)"""
    pairs: dict[int, dict[str, float]] = {}
    for e, p in heldout_scores["names"]:
        if "pair" in e:
            pairs.setdefault(e["pair"], {})[e["label"]] = p
    right = [p["positive"] > p["negative"] and p["negative"] < 0.5 for p in pairs.values()]
    assert len(pairs) >= 20 and sum(right) >= 0.9 * len(pairs), pairs
