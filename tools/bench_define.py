"""What defining a live concept costs: how long a define of 48 + 48 examples takes, alone and
while 8 streams generate, and those streams' throughput before and during it.

One `salience serve` on the default model (compiled, readouts on). The examples are the first 48
of each side of the built-in set's `french` concept (salience/concept_specs/default), defined
under another name and deleted after each define. Each phase is repeated; medians are printed.

    .venv/bin/python -m tools.bench_define [--streams 8] [--examples 48] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as `python tools/bench_define.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.lmtp.client import LmtpClient
from tools.bench_readout import _eos
from tools.harness import Report, arguments, prompts, salience_serve, serve

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
        await asyncio.gather(*(self._stream(prompt) for prompt in prompts(self.n, 64, 40000)))

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
    parser = arguments(__doc__)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--baseline-seconds", type=float, default=10.0)
    args = parser.parse_args()

    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.home import configure_environment

    configure_environment()
    eos = _eos(ensure_default_model())
    positive, negative = examples(args.examples)
    report = Report("bench_define", args)
    samples = report.samples
    with serve("default", salience_serve("--max-model-len", "2048")) as server:
        await define(server.url, "warmup", positive, negative)
        for repeat in range(args.repeats):  # the phases in this order: the load starts after the idle define
            alone = await define(server.url, f"alone{repeat}", positive, negative)
            load = Load(server.url, DEFAULT_MODEL_NAME, args.streams, eos)
            task = asyncio.create_task(load.run())
            await asyncio.sleep(2.0)  # every stream under way
            mark = time.perf_counter()
            await asyncio.sleep(args.baseline_seconds)
            defining = time.perf_counter()
            loaded = await define(server.url, f"loaded{repeat}", positive, negative)
            done = time.perf_counter()
            load.stop()
            await task
            before, during = load.rate(mark, defining), load.rate(defining, done)
            samples.add(
                f"define alone {alone:.1f} s, beside {args.streams} streams {loaded:.1f} s; "
                f"streams {before:.1f} tok/s before, {during:.1f} during",
                {"define alone s": alone, "define loaded s": loaded, "before tok/s": before, "during tok/s": during},
            )
    table = report.table(
        f"{DEFAULT_MODEL_NAME}, a live concept from {args.examples} + {args.examples} examples, "
        f"median of {args.repeats}",
        ("", ""),
        ("value", "{:.2f}"),
        ("unit", ""),
    )
    table.add("define, server idle", samples.median("define alone s"), "s")
    table.add(f"define, beside {args.streams} generating streams", samples.median("define loaded s"), "s")
    table.add("the streams before the define", samples.median("before tok/s"), "tok/s")
    table.add("the streams during the define", samples.median("during tok/s"), "tok/s")
    table.add("during / before", samples.median("during tok/s") / samples.median("before tok/s"), "")
    report.emit()


if __name__ == "__main__":
    asyncio.run(main())
