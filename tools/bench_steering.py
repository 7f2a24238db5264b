"""What steering costs: 8 concurrent steered streams against 8 unsteered ones, and against a
server that cannot steer at all.

Two core engines on the default model (compiled, the built-in concept set: as `salience serve`
runs it), started once and measured in turn in one run:

- `--no-steering`: the fastest configuration a user could pick who never steers (no steering
  terms in the graph);
- the default, steering on: batches of unsteered streams, and batches of steered streams that
  add a concept at a middle layer at every position (the salted cache, the coefficient writes
  and the taps' work all included).

For each stream count N, each batch is N concurrent greedy streams, P-token prompts, M tokens each, EOS ignored, with
prompts of its own so that nothing is served from the prefix cache; the three kinds rotate,
repeated. Reported: median tokens/s of each, steered / unsteered on the same engine (the
target is >= 0.90), and both against `--no-steering`. With readouts, every generated token
also asks for its readout, in every kind.

    .venv/bin/python -m tools.bench_steering [--streams 1,8,16] [--tokens 64] [--repeats 5] [--readouts] [--json PATH]
    .venv/bin/python -m tools.bench_steering --model DIR --concepts FILE --tokens 4 --repeats 1   # a smoke run
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

if not __package__:  # run as `python tools/bench_steering.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.home import configure_environment
from tools.harness import Report, arguments, prompts, rotations, run_main, say

configure_environment()  # before anything imports vllm or torch

NO_STEERING = "--no-steering server"
UNSTEERED = "default server, unsteered"
STEERED = "default server, steered"


def span(vocab: int) -> int:
    """The prompts' token ids: below 30050 on any model."""
    return min(vocab, 30050) - 50


async def run(engine, batch: list[list[int]], tokens: int, steer, readouts: bool) -> tuple[float, int]:
    """Seconds for the batch and the tokens it produced."""
    from salience.core.engine.requests import Probes, SamplingOptions

    options = SamplingOptions(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        ranges = [(len(prompt), len(prompt) + tokens)] if readouts else ()
        return len(
            [e async for e in engine.generate(prompt, options, probes=Probes(readout_ranges=ranges, steer=steer))]
        )

    started = time.perf_counter()
    counts = await asyncio.gather(*map(one, batch))
    return time.perf_counter() - started, sum(counts)


async def main() -> None:
    parser = arguments(__doc__, repeats=5)
    parser.add_argument("--streams", default="1,8,16", help="stream counts, each measured in turn")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--readouts", action="store_true", help="every generated token asks for its readout")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--model", type=Path, help="model folder (default: the embedded model)")
    parser.add_argument("--concepts", type=Path, help="concept set (default: the built-in set of the default model)")
    parser.add_argument("--direction", help="the concept steered along (default: the set's second, or its first)")
    parser.add_argument("--value", type=float, default=8.0, help="alpha of the add")
    args = parser.parse_args()

    from salience.core.engine.engine import Engine
    from salience.core.engine.settings import EngineSettings
    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.probes.concepts import ConceptSet
    from salience.core.probes.steering import Intervention, Op
    from salience.core.serving.default_concepts import default_concepts

    model = args.model or ensure_default_model()
    concepts = ConceptSet.load(args.concepts or default_concepts(model))
    concepts.check_model(model)
    name = DEFAULT_MODEL_NAME if args.model is None else model.name
    settings = EngineSettings(
        model=model, served_model_name=name, max_model_len=2048, concepts=concepts, compile=not args.eager
    )
    mode = "eager" if args.eager else "compiled"
    say(f"starting two engines ({mode}) on {name}: --no-steering, then the default")
    plain = await Engine.start(replace(settings, steering=False))
    engine = await Engine.start(settings)
    direction = args.direction or concepts.concepts[min(1, len(concepts.concepts) - 1)]
    layer = concepts.layers[len(concepts.layers) // 2]
    steer = [
        Intervention(direction=direction, layers=(layer,), op=Op.ADD, value=args.value, prompt=True, generated=True)
    ]
    kinds = [(NO_STEERING, plain, ()), (UNSTEERED, engine, ()), (STEERED, engine, steer)]
    counts = [int(n) for n in args.streams.split(",")]
    report = Report("bench_steering", args)
    samples = report.samples
    try:
        for n, (_, server, interventions) in enumerate(kinds):  # lazy initialisation, every path
            await run(server, prompts(1, 8, span(server.vocab_size), -1 - n), 4, interventions, args.readouts)
        for streams in counts:
            for i, (_, (kind, server, interventions)) in enumerate(rotations(kinds, args.repeats)):
                batch = prompts(streams, args.prompt_tokens, span(server.vocab_size), 1000 * streams + i)
                seconds, produced = await run(server, batch, args.tokens, interventions, args.readouts)
                expected = streams * args.tokens
                assert produced == expected, f"{kind}: {produced} tokens, expected {expected}"
                rate = produced / seconds
                samples.add(f"N={streams:<3} {kind:28} {rate:7.1f} tok/s", {f"N={streams} {kind}": rate})
    finally:
        engine.shutdown()
        plain.shutdown()

    also = "; readouts on every generated token" if args.readouts else ""
    table = report.table(
        f"{name}, core engines ({mode}), greedy streams, {args.prompt_tokens}-token prompts, {args.tokens} tokens "
        f"each, median of {args.repeats}; steered: add {args.value:g} x {direction!r} at layer {layer}, every "
        f"position{also}",
        ("streams", "{}"),
        ("--no-steering tok/s", "{:.1f}"),
        ("unsteered tok/s", "{:.1f}"),
        ("steered tok/s", "{:.1f}"),
        ("steered / unsteered", "{:.2f}"),
        ("unsteered / --no-steering", "{:.2f}"),
        ("steered / --no-steering", "{:.2f}"),
    )
    for streams in counts:
        fastest, unsteered, steered = (samples.median(f"N={streams} {k}") for k in (NO_STEERING, UNSTEERED, STEERED))
        table.add(streams, fastest, unsteered, steered, steered / unsteered, unsteered / fastest, steered / fastest)
    report.emit()


if __name__ == "__main__":
    run_main(main())
