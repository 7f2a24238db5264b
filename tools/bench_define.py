"""What defining a live concept costs: how long a define of 48 + 48 examples takes, alone and
while 8 streams generate, and those streams' throughput before and during it.

One `salience serve` on the default model (compiled, readouts on). The examples are the first 48
of each side of the built-in set's `french` concept (salience/concept_specs/default), defined
under another name and deleted after each define. Each phase is repeated; medians are printed.

    .venv/bin/python -m tools.bench_define [--streams 8] [--examples 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from salience.lmtp.client import LmtpClient
from tools.bench_readout import Server, _eos, prompts, start, stop

SPEC = Path(__file__).resolve().parent.parent / "salience" / "concept_specs" / "default" / "french.jsonl"


def examples(n: int) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in SPEC.read_text().splitlines() if line.strip()]
    return [r["text"] for r in rows if r["label"] == "positive"][:n], [
        r["text"] for r in rows if r["label"] == "negative"
    ][:n]


class Load:
    """N streams generating one after another on one connection each, counting their tokens."""

    def __init__(self, url: str, model: str, n: int, eos: int) -> None:
        self.url, self.model, self.n, self.eos = url, model, n, eos
        self.times: list[float] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await asyncio.gather(*(self._stream(prompt) for prompt in prompts(self.n, 64)))

    async def _stream(self, prompt: list[int]) -> None:
        client = await LmtpClient.connect(self.url)
        try:
            while not self._stop.is_set():
                fields = {"model": self.model, "prompt": prompt, "max_tokens": 64, "temperature": 0.0}
                async for payload in client.stream("GENERATE", logit_bias={str(self.eos): -100.0}, **fields):
                    if "token" in payload and not payload.get("prompt"):
                        self.times.append(time.perf_counter())
        finally:
            await client.close()

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / (end - start)

    def stop(self) -> None:
        self._stop.set()


async def define(url: str, name: str, positive: list[str], negative: list[str]) -> float:
    client = await LmtpClient.connect(url)
    try:
        started = time.perf_counter()
        await client.request("DEFINE_CONCEPT", name=name, positive=positive, negative=negative)
        seconds = time.perf_counter() - started
        await client.request("DELETE_CONCEPT", name=name)
        return seconds
    finally:
        await client.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-seconds", type=float, default=10.0)
    args = parser.parse_args()

    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.home import configure_environment

    configure_environment()
    eos = _eos(ensure_default_model())
    positive, negative = examples(args.examples)
    server = Server("default", [], 19900)
    await start(server, DEFAULT_MODEL_NAME)
    alone, loaded, before, during = [], [], [], []
    try:
        await define(server.url, "warmup", positive, negative)
        for repeat in range(args.repeats):
            alone.append(await define(server.url, f"alone{repeat}", positive, negative))
            load = Load(server.url, DEFAULT_MODEL_NAME, args.streams, eos)
            task = asyncio.create_task(load.run())
            await asyncio.sleep(2.0)  # every stream under way
            mark = time.perf_counter()
            await asyncio.sleep(args.baseline_seconds)
            defining = time.perf_counter()
            loaded.append(await define(server.url, f"loaded{repeat}", positive, negative))
            done = time.perf_counter()
            before.append(load.rate(mark, defining))
            during.append(load.rate(defining, done))
            load.stop()
            await task
            print(
                f"  run {repeat + 1}: define alone {alone[-1]:.1f} s, beside {args.streams} streams "
                f"{loaded[-1]:.1f} s; streams {before[-1]:.1f} tok/s before, {during[-1]:.1f} during",
                file=sys.stderr,
            )
    finally:
        stop(server)
    median = statistics.median
    print(
        f"\n{DEFAULT_MODEL_NAME}, a live concept from {args.examples} + {args.examples} examples, "
        f"median of {args.repeats}\n\n| | value |\n|---|---:|\n"
        f"| define, server idle | {median(alone):.1f} s |\n"
        f"| define, beside {args.streams} generating streams | {median(loaded):.1f} s |\n"
        f"| the streams before the define | {median(before):.1f} tok/s |\n"
        f"| the streams during the define | {median(during):.1f} tok/s |\n"
        f"| during / before | {median(during) / median(before):.2f} |"
    )


if __name__ == "__main__":
    asyncio.run(main())
