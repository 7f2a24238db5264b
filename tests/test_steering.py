"""Concept steering on the tiny model against transformers float32 with the same interventions as hooks."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from salience.core.engine.engine import Engine
from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.models.folders import model_fingerprint
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.steering import MAX_INTERVENTIONS, Intervention, Op
from salience.errors import InvalidArgument
from tests.conftest import TINY_LAYERS, start_engine
from tests.reference import Reference, assert_logprobs_match, assert_readout_close, reference_readouts
from tests.steer_reference import check_against_reference, steered

PROMPTS = [[0, *range(60 + 11 * i, 90 + 11 * i)] for i in range(8)]
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def engine(read_engine_each_mode: Engine) -> Engine:
    return read_engine_each_mode


def steer(direction: str, layers, op: str, value: float = 0.0, **positions) -> Intervention:
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    return Intervention(direction=direction, layers=layers, op=Op(op), value=value, **positions)


async def run(engine: Engine, prompt: list[int], interventions, options=GREEDY):
    generation = engine.generate(
        prompt, options, probes=Probes(readout_ranges=[(0, 2000)], steer=interventions), prompt_logprobs=5
    )
    events = [e async for e in generation]
    return generation, events


async def in_one_step(engine: Engine, runs: list) -> list:
    """Run requests so that vLLM schedules them together: its batches otherwise depend on timing,
    and batch shapes change the last bits of vLLM's numbers, with or without steering."""
    await engine._llm.pause_generation(mode="keep", clear_cache=False)
    tasks = [asyncio.create_task(r) for r in runs]
    try:
        async with asyncio.timeout(30):
            while engine.num_unfinished_requests() < len(tasks):
                await asyncio.sleep(0.01)
    finally:
        await engine._llm.resume_generation()
    return await asyncio.gather(*tasks)


CASES = {
    "add, all positions": [steer("beta", 2, "add", 6.0, prompt=True, generated=True)],
    "set, generated positions": [steer("gamma", 0, "set", -4.0, generated=True)],
    "ablate, prompt ranges": [steer("alpha", 2, "ablate", ranges=((3, 9), (20, 25)))],
    "two layers at once": [
        steer("delta", 0, "add", -5.0, prompt=True, generated=True),
        steer("alpha", 3, "set", 3.0, ranges=((10, 40),)),
    ],
    "one intervention, several layers; a range into the decoded tokens": [
        steer("epsilon", (0, 2, 3), "add", 4.0, ranges=((28, 34),))
    ],
}


@pytest.mark.parametrize("case", list(CASES))
async def test_matches_reference(engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet, case: str):
    interventions = CASES[case]
    prompt = PROMPTS[1]
    generation, events = await run(engine, prompt, interventions)
    ids = check_against_reference(tiny_reference, tiny_concepts, prompt, interventions, GREEDY, generation, events)
    # And the intervention did something: the logprobs are not the unsteered model's.
    plain = tiny_reference.logprobs(ids)
    scores = generation.prompt_scores()
    got = [scores.at(p).logprob for p in range(1, len(prompt))] + [e.logprob for e in events]
    unsteered = [float(plain[p - 1][ids[p]]) for p in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(got, unsteered, strict=True)) > 1e-2


async def test_set_and_ablate_fix_the_readout_at_their_layer(engine: Engine, tiny_concepts: ConceptSet) -> None:
    """Readouts report the steered residual: after `set` the projection is the value, after `ablate` zero."""
    slot, k = TINY_LAYERS.index(2), tiny_concepts.concepts.index("beta")
    width = len(tiny_concepts.concepts)
    for op, value in (("set", 7.5), ("ablate", 0.0)):
        generation, events = await run(engine, PROMPTS[2], [steer("beta", 2, op, value, prompt=True, generated=True)])
        rows = {**generation.prompt_readouts, **{e.position: e.readout for e in events}}
        assert sorted(rows) == list(range(len(PROMPTS[2]) + GREEDY.max_tokens))
        assert all(math.isclose(row[slot * width + k], value, abs_tol=1e-4) for row in rows.values())


async def test_score_is_steered_like_the_generation(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    """SCORE's `generated` positions are the continuation's: scoring a steered generation's own tokens
    gives the generation's logprobs."""
    interventions = [steer("gamma", 2, "add", 5.0, generated=True), steer("beta", 0, "ablate", ranges=((2, 6),))]
    prompt = PROMPTS[3]
    options = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
    events = [e async for e in engine.generate(prompt, options, probes=Probes(steer=interventions))]
    continuation = [e.token_id for e in events]
    assert len(continuation) == options.max_tokens
    scored = await engine.score(prompt, continuation, probes=Probes(readout_ranges=[(0, 100)], steer=interventions))
    assert [s.position for s in scored] == list(range(len(prompt), len(prompt) + options.max_tokens))
    assert [s.logprob for s in scored] == pytest.approx([e.logprob for e in events], abs=1e-5)
    ids = prompt + continuation
    with steered(tiny_reference.model, [tiny_concepts], interventions, len(prompt)):
        want = reference_readouts(tiny_reference, tiny_concepts, ids)
    for token in scored:
        assert_readout_close(token.readout, want[token.position])


async def test_a_batch_mixing_steered_and_unsteered_requests(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    """Each request gets its own interventions or none. The unsteered ones are bit-identical to the
    same batch run with no steering at all, and equal to a run alone (to vLLM's own rounding
    differences between batch shapes, which are there without steering too)."""
    mixed = {
        0: [steer("alpha", 0, "add", 6.0, prompt=True, generated=True)],
        2: [steer("beta", 2, "set", -3.0, generated=True)],
        4: [steer("gamma", 3, "ablate", prompt=True)],
        6: [steer("delta", (0, 3), "add", -4.0, ranges=((5, 36),))],
    }

    def outcome(generation, events):
        return events, generation.prompt_readouts, generation.prompt_scores().entries

    plain = await in_one_step(engine, [run(engine, PROMPTS[i], ()) for i in range(8)])
    results = await in_one_step(engine, [run(engine, PROMPTS[i], mixed.get(i, ())) for i in range(8)])
    for i, (generation, events) in enumerate(results):
        if i in mixed:
            check_against_reference(tiny_reference, tiny_concepts, PROMPTS[i], mixed[i], GREEDY, generation, events)
            continue
        assert len(events) == GREEDY.max_tokens
        assert outcome(generation, events) == outcome(*plain[i])  # tokens, logprobs, readouts: every bit
        alone, alone_events = await run(engine, PROMPTS[i], ())
        assert [e.token_id for e in events] == [e.token_id for e in alone_events]
        for event, single in zip(events, alone_events, strict=True):
            assert event.logprob == pytest.approx(single.logprob, abs=1e-5)
            assert event.readout == pytest.approx(single.readout, rel=1e-5, abs=1e-6)
        for position, readout in generation.prompt_readouts.items():
            assert readout == pytest.approx(alone.prompt_readouts[position], rel=1e-5, abs=1e-6)


async def test_prefix_cache_never_crosses_interventions(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    options = SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)
    on_prompt = [steer("beta", 2, "add", 6.0, ranges=((5, 400),))]
    for n, order in enumerate(((on_prompt, ()), ((), on_prompt))):
        prompt = [0, *[(7 * j + 101 * n) % 1900 + 5 for j in range(600)]]  # several 128-token KV blocks
        for interventions in (*order, order[0]):
            generation = engine.generate(prompt, options, probes=Probes(steer=interventions))
            events = [e async for e in generation]
            ids = prompt + [e.token_id for e in events]
            with steered(tiny_reference.model, [tiny_concepts], interventions, len(prompt)):
                assert ids[len(prompt) :] == tiny_reference.greedy(prompt, options.max_tokens)
                assert_logprobs_match(events, tiny_reference.logprobs(ids).float(), options.logprobs)
        # The third request repeats the first: same interventions, same prompt, the cache hits.
        assert generation.cached_tokens >= 512


async def test_the_last_tokens_readout_pass_is_steered_and_reads_the_cache(
    engine: Engine, tiny_reference: Reference, tiny_concepts: ConceptSet
) -> None:
    interventions = [steer("alpha", 3, "add", 5.0, generated=True)]
    prompt = [0, *[(11 * j) % 1900 + 5 for j in range(300)]]
    options = SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    events = [
        e
        async for e in engine.generate(prompt, options, probes=Probes(readout_ranges=[(300, 400)], steer=interventions))
    ]
    ids = prompt + [e.token_id for e in events]
    with steered(tiny_reference.model, [tiny_concepts], interventions, len(prompt)):
        want = reference_readouts(tiny_reference, tiny_concepts, ids)
    assert [e.position for e in events if e.readout is not None] == list(range(301, 305))
    for event in events:
        assert_readout_close(event.readout, want[event.position])


async def test_steering_state_is_freed(engine: Engine) -> None:
    interventions = [steer("alpha", 0, "add", 1.0, generated=True)]

    async def finish(i: int) -> None:
        [
            e
            async for e in engine.generate(
                PROMPTS[i % 8][:8], SamplingOptions(max_tokens=2), probes=Probes(steer=interventions)
            )
        ]

    async def abandon(i: int) -> None:
        generation = engine.generate(
            PROMPTS[i % 8][:8], SamplingOptions(max_tokens=500), probes=Probes(steer=interventions)
        )
        await anext(generation)
        await generation.aclose()

    for start in range(0, 600, 60):
        await asyncio.gather(*(finish(i) for i in range(start, start + 50)), *(abandon(i) for i in range(10)))
    await asyncio.sleep(0.2)
    assert engine.num_unfinished_requests() == 0
    # One step with nothing steered runs the forward; plans of finished requests are dropped then.
    [e async for e in engine.generate(PROMPTS[0], SamplingOptions(max_tokens=2))]
    assert (await engine._llm.collective_rpc("salience_steering_plans"))[0] == 0


BAD = [
    ([steer("zeta", 2, "add", 1.0, generated=True)], "unknown direction 'zeta'"),
    ([steer("alpha", 1, "add", 1.0, generated=True)], "has no vector at layer 1"),
    ([steer("alpha", 4, "add", 1.0, generated=True)], r"layer 4 is not a layer of this model \(0..3\)"),
    ([steer("alpha", 2, "add", math.inf, generated=True)], "value must be a finite number"),
    ([steer("alpha", 2, "set", math.nan, generated=True)], "value must be a finite number"),
    ([steer("alpha", 2, "add", 1e5, generated=True)], "at most 10000"),
    ([steer("alpha", 2, "ablate", 1.0, generated=True)], "ablate takes no value"),
    ([steer("alpha", 2, "add", 1.0)], "names no positions"),
    ([steer("alpha", 2, "add", 1.0, ranges=((5, 2),))], "range 0 must satisfy 0 <= start < end"),
    ([steer("alpha", 2, "add", 1.0, generated=True)] * (MAX_INTERVENTIONS + 1), "at most 16 are allowed"),
    ([steer("alpha", (), "add", 1.0, generated=True)], "names no layer"),
]


@pytest.mark.parametrize(("interventions", "message"), BAD)
async def test_bad_interventions_never_reach_the_engine(engine: Engine, interventions, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        engine.generate(PROMPTS[0], GREEDY, probes=Probes(steer=interventions))
    with pytest.raises(InvalidArgument, match=message):
        await engine.score(PROMPTS[0][:5], PROMPTS[0][5:], probes=Probes(steer=interventions))
    assert engine.num_unfinished_requests() == 0


async def test_a_server_without_directions_refuses_steering(tiny_engine: Engine) -> None:
    with pytest.raises(InvalidArgument, match="nothing to steer along"):
        tiny_engine.generate([0, 1], GREEDY, probes=Probes(steer=[steer("alpha", 2, "add", 1.0, generated=True)]))


@pytest.fixture(scope="module")
def steering_set(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ConceptSet:
    """Two directions at layers 1 and 2: layer 1 holds no concept vector, so it is tapped for steering only."""
    generator = torch.Generator().manual_seed(2)
    vectors = {layer: torch.randn(2, 128, generator=generator) * 3 for layer in (1, 2)}  # not unit: normalised
    built = ConceptSet(
        concepts=("up", "down"),
        vectors=vectors,
        hidden_size=128,
        num_layers=4,
        model_fingerprint=model_fingerprint(tiny_model),
    )
    path = tmp_path_factory.mktemp("steering") / "steering.safetensors"
    built.save(path)
    return ConceptSet.load(path)


async def test_a_steering_set_and_a_server_without_steering(
    engine: Engine, tiny_model: Path, tiny_concepts: ConceptSet, steering_set: ConceptSet, tiny_reference: Reference
) -> None:
    """`--steering FILE` adds directions, at layers readouts do not read too; with steering off the
    numbers are those of the steering engine's unsteered requests, bit for bit (in the engine's mode)."""
    both = await start_engine(
        tiny_model, max_model_len=1024, concepts=tiny_concepts, steering_set=steering_set, compile=engine.compiled
    )
    try:
        assert both.steering.names == (*tiny_concepts.concepts, "up", "down")
        assert (await both.readouts.graph())["taps"] == len(TINY_LAYERS) + 1
        interventions = [
            steer("up", 1, "add", 4.0, prompt=True, generated=True),
            steer("down", 2, "set", -2.0, generated=True),
            steer("alpha", 2, "add", 2.0, ranges=((4, 12),)),
        ]
        generation, events = await run(both, PROMPTS[4], interventions)
        check_against_reference(
            tiny_reference, tiny_concepts, PROMPTS[4], interventions, GREEDY, generation, events, steering_set
        )
        with pytest.raises(InvalidArgument, match=r"'up' has no vector at layer 0 \(it has \[1, 2\]\)"):
            both.generate(PROMPTS[0], GREEDY, probes=Probes(steer=[steer("up", 0, "add", 1.0, generated=True)]))
    finally:
        both.shutdown()
    off = await start_engine(
        tiny_model, max_model_len=1024, concepts=tiny_concepts, steering=False, compile=engine.compiled
    )
    try:
        assert off.steering is None
        with pytest.raises(InvalidArgument, match="nothing to steer along"):
            off.generate(PROMPTS[0], GREEDY, probes=Probes(steer=[steer("alpha", 2, "add", 1.0, generated=True)]))
        for prompt in PROMPTS[:3]:
            without, events_without = await run(off, prompt, ())
            with_, events_with = await run(engine, prompt, ())
            assert len(events_with) == GREEDY.max_tokens and events_without == events_with
            assert sorted(with_.prompt_readouts) == list(range(len(prompt)))
            assert without.prompt_readouts == with_.prompt_readouts
            assert without.prompt_scores().entries == with_.prompt_scores().entries
    finally:
        off.shutdown()


@pytest.mark.multiprocess
async def test_tensor_parallel_ranks_steer_alike(
    tensor_parallel_engine: Engine, tiny_concepts: ConceptSet, tiny_reference: Reference
) -> None:
    """TP=2 (eager, then compiled): every rank holds the whole residual after a layer and writes the
    same coefficients."""
    interventions = CASES["two layers at once"]
    generation, events = await run(tensor_parallel_engine, PROMPTS[5], interventions)
    check_against_reference(tiny_reference, tiny_concepts, PROMPTS[5], interventions, GREEDY, generation, events)
