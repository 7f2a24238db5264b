"""Fair share across clients (issue 36): client A keeps many greedy streams busy, client B 1, then
4, all running at once on one engine; the same run with fair share and first come, first served.

One engine in-process (`Engine.generate(..., client=)`: the bench names the clients itself), the
default model, compiled as `salience serve` runs it but with no concept set (scheduling is what
is measured), `--max-model-len` 2048. Every stream is a loop of requests, each a fresh
`--prompt-tokens` prompt (the prefix cache serves none of it), greedy, EOS masked with logit_bias.
B's requests ask for `--tokens` tokens; A's for 1/2 to 3/2 of that, spread over its streams, so
that they do not all end in the same step. Ways, in rotating order each round:

- `fair`: the engine's fair share (`--max-running`; default 3/4 of vLLM's max_num_seqs);
- `fcfs`: the same engine with fair share off: every request straight to vLLM, first come first
  served;
- `idle`: B alone, for its idle time to first token.

Each way runs `--settle` seconds (the first prefills), then `--seconds` measured: tokens per
client whose events came in that window, and B's TTFT (request to first token) for its requests
sent in it. B's fair share is the window's total tokens/s x B's weight share (1/2). What B asks
for is one token a step per stream: its streams x the engine's steps per second, read as the
tokens/s of the busiest single stream. B's target is the lesser of the two. Goals: B / target at
least 0.8, total / FCFS at least 0.95, B's TTFT p95 / idle at most 3. Medians over rounds; ratios
are medians of each round's ratio.

    .venv/bin/python -m tools.bench_fairness [--a-streams 64] [--b-streams 1,4] [--tokens 64]
        [--prompt-tokens 64] [--seconds 30] [--settle 5] [--max-running N] [--eager] [--model DIR]
        [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as `python tools/bench_fairness.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.home import configure_environment
from salience.logs import setup_logging

configure_environment()
setup_logging()  # before vLLM is imported: its processes log quietly too

from salience.core.engine.engine import Engine  # noqa: E402
from salience.core.engine.requests import SamplingOptions  # noqa: E402
from salience.core.engine.settings import EngineSettings  # noqa: E402
from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from tools.harness import Report, arguments, percentile, prompts, rotations, run_main, say  # noqa: E402

WAYS = ("fair", "fcfs", "idle")
PAUSE_SECONDS = 3.0  # before each measurement: vLLM's threads stay busy a while after a run


@dataclass
class Window:
    """What one way's run saw between `start` and `end`."""

    start: float
    end: float
    tokens: Counter[str] = field(default_factory=Counter)  # per client
    per_stream: Counter[str] = field(default_factory=Counter)
    ttfts: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def seen(self, client: str, stream: str, sent: float, at: float, first: bool) -> None:
        if self.start <= at < self.end:
            self.tokens[client] += 1
            self.per_stream[stream] += 1
        if first and self.start <= sent < self.end:
            self.ttfts[client].append(at - sent)


async def run(
    engine: Engine, a_streams: int, b_streams: int, args: argparse.Namespace, bias: dict[int, float]
) -> Window:
    """A's and B's streams at once for settle + seconds; what the measured window saw."""
    began = time.perf_counter()
    window = Window(began + args.settle, began + args.settle + args.seconds)
    batches = itertools.count()

    async def stream(client: str, name: str, tokens: int) -> None:
        while time.perf_counter() < window.end:
            prompt = prompts(1, args.prompt_tokens, engine.vocab_size - 100, batch=next(batches))[0]
            options = SamplingOptions(max_tokens=tokens, temperature=0.0, logit_bias=bias)
            sent, first = time.perf_counter(), True
            async with engine.generate(prompt, options, client=client) as generation:
                async for _ in generation:
                    at = time.perf_counter()
                    window.seen(client, name, sent, at, first)
                    first = False
                    if at >= window.end:
                        break  # closing the generation aborts the request

    a = [stream("a", f"a{i}", args.tokens // 2 + args.tokens * i // max(a_streams - 1, 1)) for i in range(a_streams)]
    b = [stream("b", f"b{i}", args.tokens) for i in range(b_streams)]
    await asyncio.gather(*a, *b)
    return window


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", type=Path, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--a-streams", type=int, default=64, help="client A's streams (%(default)s)")
    parser.add_argument("--b-streams", default="1,4", help="client B's streams, one count per table (%(default)s)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens each of B's requests asks for (%(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="(%(default)s)")
    parser.add_argument("--seconds", type=float, default=30.0, help="the measured window (%(default)s)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds run before the window (%(default)s)")
    parser.add_argument("--max-running", type=int, help="fair share's N (default: the engine's, see salience serve)")
    parser.add_argument("--eager", action="store_true", help="run the model eagerly (default: compiled)")
    args = parser.parse_args()
    model = args.model or ensure_default_model()
    name = DEFAULT_MODEL_NAME if args.model is None else model.name
    counts = [int(n) for n in args.b_streams.split(",")]
    report = Report("bench_fairness", args)
    samples = report.samples

    say(f"loading {name} ...")
    settings = EngineSettings(
        model=model, served_model_name=name, max_model_len=2048, compile=not args.eager, max_running=args.max_running
    )
    engine = await Engine.start(settings)
    fair = engine.fair_share
    bias = {engine.tokenizer.eos_token_id: -100.0}

    for k in counts:
        for _, way in rotations(WAYS, args.repeats):
            while engine.num_unfinished_requests():
                await asyncio.sleep(0.1)
            await asyncio.sleep(PAUSE_SECONDS)
            engine.fair_share = None if way == "fcfs" else fair
            window = await run(engine, 0 if way == "idle" else args.a_streams, k, args, bias)
            engine.fair_share = fair
            rate = {client: window.tokens[client] / args.seconds for client in ("a", "b")}
            total = rate["a"] + rate["b"]
            asks = k * max(window.per_stream.values(), default=0) / args.seconds
            target = min(total / 2, asks)
            ttft = percentile(window.ttfts["b"], 0.95) if window.ttfts["b"] else float("nan")
            samples.add(
                f"B={k} {way:4} total {total:6.1f} tok/s, B {rate['b']:5.1f}, TTFT p95 {ttft:.2f} s",
                {
                    f"{k} {way} total": total,
                    f"{k} {way} a": rate["a"],
                    f"{k} {way} b": rate["b"],
                    f"{k} {way} share": total / 2,
                    f"{k} {way} asks": asks,
                    f"{k} {way} b/target": rate["b"] / target if target else float("nan"),
                    f"{k} {way} ttft": ttft,
                },
            )
    engine.shutdown()

    report.text(
        f"Client A: {args.a_streams} streams; B: as titled. {name}, compiled: {not args.eager}, fair share's N: "
        f"{fair.max_running} of {fair.room} vLLM runs at once. Goals: B / target >= 0.8, total / FCFS >= 0.95, "
        "B's TTFT p95 / idle <= 3."
    )
    for k in counts:
        table = report.table(
            f"B with {k} stream{'s' if k > 1 else ''}: prompts {args.prompt_tokens} tokens, B's requests {args.tokens} "
            f"tokens, {args.seconds:g} s windows, median of {args.repeats}",
            ("way", ""),
            ("total tok/s", "{:.1f}"),
            ("A tok/s", "{:.1f}"),
            ("B tok/s", "{:.1f}"),
            ("B's share", "{:.1f}"),
            ("B asks", "{:.1f}"),
            ("B / target", "{:.2f}"),
            ("total / FCFS", "{:.3f}"),
            ("B TTFT p95 s", "{:.2f}"),
            ("TTFT / idle", "{:.2f}"),
        )
        for way in WAYS:
            key = f"{k} {way}"
            contended = way != "idle"
            table.add(
                way,
                samples.median(f"{key} total"),
                samples.median(f"{key} a") if contended else None,
                samples.median(f"{key} b"),
                samples.median(f"{key} share") if contended else None,
                samples.median(f"{key} asks"),
                samples.median(f"{key} b/target") if contended else None,
                samples.paired(f"{key} total", f"{k} fcfs total") if contended else None,
                samples.median(f"{key} ttft"),
                samples.paired(f"{key} ttft", f"{k} idle ttft"),
            )
    report.emit()


if __name__ == "__main__":
    run_main(main())
