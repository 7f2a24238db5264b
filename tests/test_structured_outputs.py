"""Structured outputs in the core engine, on the tiny model: each kind of constraint holds on every
sample, a constrained request beside an unconstrained one in the same batch (or before it in the
prefix cache) changes nothing of the unconstrained one's, and a constraint the backend refuses is
an InvalidArgument naming its field before anything reaches vLLM, while other requests run on;
validation runs off the event loop, and its verdicts are kept, a bounded number of them."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from pathlib import Path

import pytest

from salience.core.engine.constraints import CHECKED, parse_constraint
from salience.core.engine.engine import Engine
from salience.core.engine.requests import FinishReason, SamplingOptions, TokenEvent
from salience.errors import InvalidArgument
from tests.engines import settled
from tests.grammar_reference import MaskedReference
from tests.reference import Reference

PROMPT = [0, *range(40, 60)]


async def run(engine: Engine, prompt: list[int], **options) -> list[TokenEvent]:
    return [event async for event in engine.generate(prompt, SamplingOptions(**options))]


def text(engine: Engine, events: list[TokenEvent]) -> str:
    """The completion's text, the EOS that ends it left out."""
    ids = [e.token_id for e in events]
    if events and events[-1].finish_reason is FinishReason.STOP:
        ids = ids[:-1]
    return engine.tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("spec", "matches"),
    [
        ({"regex": r"[0-9]{3}-[a-z]{2,4}"}, re.compile(r"[0-9]{3}-[a-z]{2,4}").fullmatch),
        ({"choice": ["alpha", "beta gamma", "delta"]}, lambda t: t in ("alpha", "beta gamma", "delta")),
        ({"grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]'}, re.compile(r"(yes|no), [0-9]{2}").fullmatch),
        (
            {"grammar": 'start: WORD "=" NUMBER\nWORD: /[a-z]{1,5}/\nNUMBER: /[0-9]{1,3}/'},  # Lark
            re.compile(r"[a-z]{1,5}=[0-9]{1,3}").fullmatch,
        ),
    ],
    ids=["regex", "choice", "gbnf", "lark"],
)
async def test_every_sample_matches_its_constraint(tiny_engine: Engine, spec: dict, matches) -> None:
    constraint = parse_constraint(spec)
    runs = [
        run(tiny_engine, PROMPT, max_tokens=40, temperature=1.0, seed=s, structured_outputs=constraint)
        for s in range(8)
    ]
    runs.append(run(tiny_engine, PROMPT, max_tokens=40, temperature=0.0, structured_outputs=constraint))
    for events in await asyncio.gather(*runs):
        assert events[-1].finish_reason is FinishReason.STOP  # the grammar ended, and EOS with it
        assert matches(text(tiny_engine, events)), text(tiny_engine, events)
    # a random model left alone writes nothing of the kind
    assert not matches(text(tiny_engine, await run(tiny_engine, PROMPT, max_tokens=12, temperature=0.0)))


async def test_a_constraint_stays_with_its_request_in_the_batch_and_the_prefix_cache(
    tiny_engine: Engine, tiny_reference: Reference
) -> None:
    long = [0, *range(40, 269)]  # 230 tokens: a repeat reads its first KV block from the cache
    digits = parse_constraint({"regex": "[0-9]{40}"})
    alone = await run(tiny_engine, long, max_tokens=30, temperature=0.0, ignore_eos=True)
    assert len(alone) == 30
    # side by side: submitted together, they share every decode step
    beside, constrained = await asyncio.gather(
        run(tiny_engine, long, max_tokens=30, temperature=0.0, ignore_eos=True),
        run(tiny_engine, long, max_tokens=50, temperature=0.0, structured_outputs=digits),
    )
    assert [e.token_id for e in beside] == [e.token_id for e in alone]
    assert [e.logprob for e in beside] == pytest.approx([e.logprob for e in alone], abs=1e-5)
    assert re.fullmatch("[0-9]{40}", text(tiny_engine, constrained))
    # after the constrained request, its prompt and tokens in the cache
    generation = tiny_engine.generate(long, SamplingOptions(max_tokens=30, temperature=0.0, ignore_eos=True))
    after = [event async for event in generation]
    assert generation.cached_tokens > 0
    assert [e.token_id for e in after] == [e.token_id for e in alone]
    # the constrained request's prompt and output, continued without a constraint: the cache serves
    # a block that holds constrained tokens
    continued = [*long, *(e.token_id for e in constrained[:-1])]
    generation = tiny_engine.generate(continued, SamplingOptions(max_tokens=5, temperature=0.0, ignore_eos=True))
    free = [event async for event in generation]
    assert generation.cached_tokens > len(long)
    assert [e.token_id for e in free] == tiny_reference.greedy(continued, 5)


BAD = [
    ({"regex": "[a-z"}, "structured_outputs.regex: Grammar error"),
    ({"grammar": "root ::= foo"}, "structured_outputs.grammar: Invalid grammar specification"),
    ({"json": {"type": "nonsense"}}, "structured_outputs.json: Grammar error: Invalid type: nonsense"),
    ({"json": {"$ref": "#/$defs/missing"}}, "structured_outputs.json: Grammar error"),
    # a feature no backend vLLM falls back to has
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json: Grammar error: Unimplemented keys"),
]


async def test_a_constraint_the_backend_refuses_is_refused_before_vllm_while_others_run(tiny_engine: Engine) -> None:
    running = tiny_engine.generate(PROMPT, SamplingOptions(max_tokens=200, temperature=0.0, ignore_eos=True))
    first = await anext(running)
    for spec, message in BAD:
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            tiny_engine.generate(PROMPT, SamplingOptions(max_tokens=8, structured_outputs=parse_constraint(spec)))
    assert tiny_engine.num_unfinished_requests() == 1  # the refused never reached vLLM
    rest = [event async for event in running]
    assert len([first, *rest]) == 200 and rest[-1].finish_reason is FinishReason.LENGTH
    assert await settled(tiny_engine) == 0


async def test_a_constraint_is_validated_off_the_event_loop_and_its_verdict_kept_with_a_bound(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = tiny_engine.checks.constraints
    verify, entered, release = backend._verify, threading.Event(), threading.Event()

    def slow(c):  # a schema that takes long to parse: held until the stream has moved on
        entered.set()
        release.wait(120)
        return verify(c)

    monkeypatch.setattr(backend, "_verify", slow)
    digits = parse_constraint({"regex": "[0-9]{6}"})
    running = tiny_engine.generate(PROMPT, SamplingOptions(max_tokens=60, temperature=0.0, ignore_eos=True))
    await anext(running)
    check = asyncio.create_task(tiny_engine.checks.constraint(digits))
    await asyncio.to_thread(entered.wait, 120)
    # on the loop, this stream's tokens keep coming while the validation is held in its thread
    moved = [await anext(running) for _ in range(30)]
    assert len(moved) == 30 and not check.done()
    release.set()
    await check
    rest = [event async for event in running]
    assert rest[-1].finish_reason is FinishReason.LENGTH
    calls: list = []
    monkeypatch.setattr(backend, "_verify", lambda c: calls.append(c) or "refused")
    events = await run(tiny_engine, PROMPT, max_tokens=12, temperature=1.0, seed=1, structured_outputs=digits)
    assert calls == [] and re.fullmatch("[0-9]{6}", text(tiny_engine, events))  # the kept verdict
    for n in range(CHECKED):  # as many others: `digits` is the least recent, and goes
        await tiny_engine.checks.constraint(parse_constraint({"regex": f"x{n}"}))
    assert len(calls) == CHECKED
    with pytest.raises(InvalidArgument, match=r"^structured_outputs\.regex: refused$"):
        tiny_engine.generate(PROMPT, SamplingOptions(max_tokens=4, structured_outputs=digits))
    assert len(calls) == CHECKED + 1  # validated again, on the caller's thread
    assert await settled(tiny_engine) == 0


async def test_min_tokens_and_min_p_reach_vllm(tiny_engine: Engine) -> None:
    first = (await run(tiny_engine, PROMPT, max_tokens=1, temperature=0.0))[0].token_id
    stopped = await run(tiny_engine, PROMPT, max_tokens=6, temperature=0.0, stop_token_ids=(first,))
    assert len(stopped) == 1 and stopped[0].finish_reason is FinishReason.STOP
    held = await run(tiny_engine, PROMPT, max_tokens=6, temperature=0.0, stop_token_ids=(first,), min_tokens=3)
    assert len(held) > 3 and first not in [e.token_id for e in held[:3]]
    params = tiny_engine.checks.sampling_params(SamplingOptions(min_p=0.2, min_tokens=2))
    assert (params.min_p, params.min_tokens) == (0.2, 2)
    for options, field in ((SamplingOptions(min_p=1.5), "min_p"), (SamplingOptions(min_tokens=20), "min_tokens")):
        with pytest.raises(InvalidArgument, match=f"^{field}"):
            tiny_engine.checks.sampling_params(options)


SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
    }
)


async def check_masked(engine: Engine, folder: Path, prompt: list[int]) -> list[list[TokenEvent]]:
    """Every token and its logprob (the masked distribution's) as transformers' float32 argmax with
    xgrammar's mask for the same schema or regex: the mask is this request's, at every step."""
    masked = MaskedReference(Reference(folder), folder, engine.vocab_size)
    runs = []
    for kind, spec in (("json", SCHEMA), ("regex", r"\((yes|no|maybe)\) [a-z ]{3,12}\.")):
        constraint = parse_constraint({kind: json.loads(spec) if kind == "json" else spec})
        events = await run(engine, prompt, max_tokens=48, temperature=0.0, logprobs=1, structured_outputs=constraint)
        want = masked.greedy(prompt, 48, **{"schema" if kind == "json" else "regex": spec})
        assert [e.token_id for e in events] == [t for t, _ in want]
        assert [e.logprob for e in events] == pytest.approx([lp for _, lp in want], abs=1e-4)
        runs.append(events)
    return runs


async def test_greedy_under_a_constraint_is_the_masked_reference_on_the_tiny_model(
    tiny_engine: Engine, tiny_model: Path
) -> None:
    await check_masked(tiny_engine, tiny_model, PROMPT)


async def test_greedy_under_a_constraint_is_the_masked_reference_on_the_default_model(
    default_engine: Engine, default_model: Path
) -> None:
    question = [{"role": "user", "content": "Name a big city and its rank by size, as JSON."}]
    prompt = default_engine.tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
    structured, _ = await check_masked(default_engine, default_model, list(prompt))
    assert structured[-1].finish_reason is FinishReason.STOP  # a real model ends the object, and it parses
    assert set(json.loads(text(default_engine, structured))) == {"city", "rank"}
