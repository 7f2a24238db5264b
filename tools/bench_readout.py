"""Decode throughput with concept readouts on every token against the same requests without.

One engine (the default model with its built-in concept set, all layers), one run:
batches of N concurrent streams of M tokens, each run once asking for readouts of
every decoded position and once asking for none, in alternating order, repeated;
prints tokens/s for both and the ratio (target: >= 0.90 at batch 8).

    .venv/bin/python tools/bench_readout.py [--batches 1,8] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from salience.core.home import configure_environment
from salience.logs import setup_logging

configure_environment()
setup_logging()  # before vLLM is imported: its processes log quietly too

from salience.cli import _default_concepts  # noqa: E402
from salience.core.concepts import ConceptSet  # noqa: E402
from salience.core.default_model import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from salience.core.engine import Engine  # noqa: E402
from salience.core.settings import EngineSettings  # noqa: E402
from salience.core.types import SamplingOptions  # noqa: E402


async def run(engine: Engine, n: int, tokens: int, readouts: bool) -> tuple[float, int, int]:
    options = SamplingOptions(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=1)

    async def one(i: int) -> tuple[int, int]:
        prompt = [1, *((131 * i + 17 * j) % 40000 + 100 for j in range(31))]
        ranges = [(len(prompt), len(prompt) + tokens)] if readouts else []
        events = [e async for e in engine.generate(prompt, options, readout_ranges=ranges)]
        return len(events), sum(e.readout is not None for e in events)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - started, sum(r[0] for r in results), sum(r[1] for r in results)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = ensure_default_model()
    concepts = ConceptSet.load(_default_concepts(model))
    print(
        f"loading {DEFAULT_MODEL_NAME} with {len(concepts.concepts)} concepts x {len(concepts.layers)} layers",
        file=sys.stderr,
    )
    engine = await Engine.start(
        EngineSettings(model=model, served_model_name=DEFAULT_MODEL_NAME, concepts=concepts, max_model_len=2048)
    )
    rows = []
    try:
        for n in [int(b) for b in args.batches.split(",")]:
            times = {False: [], True: []}
            for repeat in range(args.repeats):
                for readouts in (False, True) if repeat % 2 == 0 else (True, False):
                    seconds, produced, with_readout = await run(engine, n, args.tokens, readouts)
                    assert produced == n * args.tokens
                    assert with_readout == (n * (args.tokens - 1) if readouts else 0)
                    times[readouts].append(seconds)
                    label = "readouts" if readouts else "plain"
                    print(f"  batch {n} {label:8} run {repeat + 1}: {produced / seconds:7.1f} tok/s", file=sys.stderr)
            total = n * args.tokens
            plain, with_readouts = total / statistics.median(times[False]), total / statistics.median(times[True])
            rows.append((n, plain, with_readouts))
    finally:
        engine.shutdown()
    width = len(concepts.layers) * len(concepts.concepts)
    print(
        f"\n{DEFAULT_MODEL_NAME}, {args.tokens} tokens per stream, readout of {width} floats per token, "
        f"median of {args.repeats}"
    )
    print(f"{'batch':>5} {'plain tok/s':>12} {'readouts tok/s':>15} {'ratio':>7}")
    for n, plain, with_readouts in rows:
        print(f"{n:>5} {plain:>12.1f} {with_readouts:>15.1f} {with_readouts / plain:>7.3f}")


if __name__ == "__main__":
    asyncio.run(main())
