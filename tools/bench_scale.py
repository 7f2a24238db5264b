"""What a parallel layout costs with readouts on: tokens/s for TP=1, TP=2 and PP=2, one run.

Each layout starts the engine on the default model with the built-in concept set (compiled,
unless --eager), runs N concurrent greedy streams (P-token prompts, M tokens each, EOS masked)
that ask for the readout of every generated token, and shuts the engine down before the next
layout starts. Prints tokens/s per layout and the ratio against TP=1.

On the two CPU cores of the development machine TP=2 and PP=2 give each rank one core where
TP=1's single worker has both, so the ratios measure communication and scheduling overhead
more than speedup; docs/scaling.md says what they imply for real nodes.

    flock /tmp/salience-cpu.lock .venv/bin/python tools/bench_scale.py [--streams 8] [--tokens 64] [--eager]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

LAYOUTS = {
    "TP=1": {},
    "TP=2": {"tensor_parallel_size": 2},
    "PP=2": {"pipeline_parallel_size": 2},
}


async def measure(name: str, layout: dict, args: argparse.Namespace) -> tuple[float, float]:
    """(start seconds, generated tokens/s) for one layout."""
    from salience.cli import _default_concepts
    from salience.core.concepts import ConceptSet
    from salience.core.default_model import ensure_default_model
    from salience.core.engine import Engine
    from salience.core.settings import EngineSettings
    from salience.core.types import SamplingOptions

    model = ensure_default_model()
    concepts = ConceptSet.load(_default_concepts(model))
    started = time.monotonic()
    engine = await Engine.start(
        EngineSettings(
            model=model,
            served_model_name=model.name,
            max_model_len=2048,
            concepts=concepts,
            compile=not args.eager,
            **layout,
        )
    )
    start_seconds = time.monotonic() - started
    try:
        options = SamplingOptions(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

        async def stream(i: int) -> int:
            prompt = [1, *((7 * j + 31 * i) % 40000 + 100 for j in range(args.prompt - 1))]
            generation = engine.generate(prompt, options, readout_ranges=[(len(prompt), len(prompt) + args.tokens)])
            events = [e async for e in generation]
            assert all(e.readout is not None for e in events), f"{name}: a token without its readout"
            return len(events)

        await asyncio.gather(*(stream(i) for i in range(2)))  # warm: first requests of each batch shape
        began = time.monotonic()
        tokens = sum(await asyncio.gather(*(stream(i) for i in range(args.streams))))
        return start_seconds, tokens / (time.monotonic() - began)
    finally:
        engine.shutdown()


async def main(args: argparse.Namespace) -> int:
    results = {}
    for name in args.layouts.split(","):
        start_seconds, rate = await measure(name, LAYOUTS[name], args)
        results[name] = rate
        print(f"{name}: started in {start_seconds:.0f} s, {rate:.1f} tokens/s", flush=True)
    base = results.get("TP=1")
    print(
        f"\n{args.streams} streams x {args.tokens} tokens, readout of every generated token, "
        f"{'eager' if args.eager else 'compiled'}"
    )
    print(f"{'layout':8} {'tokens/s':>9} {'vs TP=1':>8}")
    for name, rate in results.items():
        ratio = f"{rate / base:.2f}" if base else "-"
        print(f"{name:8} {rate:9.1f} {ratio:>8}")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    parser.add_argument("--eager", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    from salience.core.home import configure_environment

    configure_environment()  # before anything imports vllm or torch
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))
