"""What a causal-tracing sweep costs: Salience's batched sweep against the transformers loops a
researcher would otherwise run, on the same CPU, in one run.

A ROME-style sweep on the default model: "The Eiffel Tower is in the city of" (clean) against the
same prompt with "Eiffel Tower" replaced by "Colosseum" (as many tokens), the answer " Paris",
resid_pre at every layer x every position: one patched run per cell. Timed, in rounds that
rotate the three (the engine started once, compiled, with --patch-points resid_pre):

- Salience: `core/serving/patch_sweep.sweep`, the clean run's rows read by the engine and every
  cell submitted at once (the engine batches them);
- transformers, one forward per cell with a forward pre-hook putting the clean row back (what
  TransformerLens's `patching.get_act_patch_resid_pre` does, one run at a time);
- transformers, every cell in one batched forward (a hook patching row b of the batch at its
  cell's layer and position): the fastest a user could write by hand.

Every grid is checked against the others (1e-3: float32 forwards of different batch shapes).
TransformerLens itself is not installed beside vLLM (its PyPI wheels pull CUDA builds that break
vLLM's import: notes/clarifications.md); the clarification's measurement of it on this machine
is 40.0 s for 270 cells against 24.9 s for the one-forward-per-cell loop.

    .venv/bin/python -m tools.bench_patching [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

if not __package__:  # run as `python tools/bench_patching.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.home import configure_environment
from tools.harness import Report, arguments, rotations, run_main, say

configure_environment()  # before anything imports vllm or torch

CLEAN = "The Eiffel Tower is in the city of"
CORRUPTED = "The Colosseum is in the city of"
ANSWER = " Paris"
KINDS = ("salience sweep", "transformers, a forward per cell", "transformers, one batched forward")


def reference_loop(model, decoder, clean_rows, corrupted, answer) -> list[list[float]]:
    """One forward per cell, a pre-hook on layer L putting the clean row back at position p."""
    import torch

    ids = torch.tensor([corrupted + answer])
    grid = []
    with torch.no_grad():
        for layer in range(len(decoder)):
            row = []
            for position in range(len(corrupted)):

                def put_back(_module, args, kwargs, layer=layer, position=position):
                    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                    hidden[0, position] = clean_rows[layer][position]

                handle = decoder[layer].register_forward_pre_hook(put_back, with_kwargs=True)
                try:
                    logits = model(ids).logits[0]
                finally:
                    handle.remove()
                row.append(_answer_logprob(logits, len(corrupted), answer))
            grid.append(row)
    return grid


def reference_batched(model, decoder, clean_rows, corrupted, answer) -> list[list[float]]:
    """Every cell a row of one batch: row b patched at its cell's layer and position."""
    import torch

    layers, positions = len(decoder), len(corrupted)
    cells = [(layer, position) for layer in range(layers) for position in range(positions)]
    ids = torch.tensor([corrupted + answer] * len(cells))
    handles = []
    for layer in range(layers):
        mine = [(b, position) for b, (at, position) in enumerate(cells) if at == layer]

        def put_back(_module, args, kwargs, layer=layer, mine=mine):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            for b, position in mine:
                hidden[b, position] = clean_rows[layer][position]

        handles.append(decoder[layer].register_forward_pre_hook(put_back, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for handle in handles:
            handle.remove()
    values = [_answer_logprob(logits[b], positions, answer) for b in range(len(cells))]
    return [values[layer * positions : (layer + 1) * positions] for layer in range(layers)]


def _answer_logprob(logits, prompt_len: int, answer: list[int]) -> float:
    import torch

    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return float(sum(logprobs[prompt_len - 1 + k, token] for k, token in enumerate(answer)))


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


async def main() -> None:
    parser = arguments(__doc__, repeats=3)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from salience.core.engine.engine import Engine
    from salience.core.engine.settings import EngineSettings
    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.families import family_of
    from salience.core.probes.concepts import ConceptSet
    from salience.core.serving.default_concepts import default_concepts
    from salience.core.serving.patch_sweep import Sweep, sweep

    model_dir = ensure_default_model()
    concepts = ConceptSet.load(default_concepts(model_dir))
    settings = EngineSettings(
        model=model_dir,
        served_model_name=DEFAULT_MODEL_NAME,
        max_model_len=2048,
        concepts=concepts,
        patch_points=("resid_pre",),
        compile=True,
    )
    say("starting the engine (compiled, --patch-points resid_pre) and loading transformers")
    engine = await Engine.start(settings)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    family = family_of(model.config.architectures)
    decoder = family.stack(model, family.hf_stack)[1]
    tokenizer = engine.tokenizer
    clean, corrupted = tokenizer.encode(CLEAN), tokenizer.encode(CORRUPTED)
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    if len(clean) != len(corrupted):
        raise SystemExit(f"the prompts tokenize to {len(clean)} and {len(corrupted)} tokens")
    with torch.no_grad():  # hidden_states[L]: the residual entering layer L (resid_pre)
        hidden = model(torch.tensor([clean]), output_hidden_states=True).hidden_states
    clean_rows = [hidden[layer][0] for layer in range(len(decoder))]
    request = Sweep(clean=tuple(clean), corrupted=tuple(corrupted), answer=tuple(answer), points=("resid_pre",))
    cells = len(decoder) * len(clean)
    report = Report("bench_patching", args)
    grids: dict[str, list[list[float]]] = {}
    try:
        await sweep(engine, request)  # lazy initialisation
        for _, kind in rotations(KINDS, args.repeats):
            started = time.perf_counter()
            if kind == KINDS[0]:
                grids[kind] = (await sweep(engine, request)).values["resid_pre"]
            elif kind == KINDS[1]:
                grids[kind] = await asyncio.to_thread(reference_loop, model, decoder, clean_rows, corrupted, answer)
            else:
                grids[kind] = await asyncio.to_thread(reference_batched, model, decoder, clean_rows, corrupted, answer)
            seconds = time.perf_counter() - started
            report.samples.add(f"{kind:36} {seconds:6.2f} s", {kind: seconds})
    finally:
        engine.shutdown()
    gaps = {kind: largest_gap(grids[KINDS[0]], grids[kind]) for kind in KINDS[1:]}
    say(f"largest gap between the grids: {gaps}")
    assert all(gap < 1e-3 for gap in gaps.values()), gaps
    samples = report.samples
    table = report.table(
        f"{DEFAULT_MODEL_NAME}, resid_pre x {len(decoder)} layers x {len(clean)} positions = {cells} patched runs, "
        f"{CLEAN!r} -> {ANSWER!r}, median of {args.repeats}; grids equal within {max(gaps.values()):.1e}",
        ("way", ""),
        ("seconds", "{:.2f}"),
        ("cells/s", "{:.1f}"),
        ("salience's speed-up", "{:.2f}"),
    )
    fastest = samples.median(KINDS[0])
    for kind in KINDS:
        seconds = samples.median(kind)
        table.add(kind, seconds, cells / seconds, seconds / fastest)
    report.emit()


if __name__ == "__main__":
    run_main(main())
