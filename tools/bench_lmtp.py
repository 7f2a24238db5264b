"""LMTP throughput: the WebSocket against the core engine, and against `lmql serve-model`.

One engine, one run: for each stream count N, N concurrent streams of M tokens go
(a) straight to the core engine and (b) through Salience's LMTP WebSocket, in
alternating order, repeated; the medians give the ratio (b)/(a). With --lmql the
same requests then go to LMQL's own server (transformers backend, its own
environment) on the same model. Every stream masks EOS with logit_bias, which
all three honour, so each produces exactly M tokens.

    .venv/bin/python -m tools.bench_lmtp [--streams 1,4,16] [--tokens 64] [--repeats 3] [--lmql] [--json PATH]
"""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import ExitStack
from pathlib import Path

if not __package__:  # run as `python tools/bench_lmtp.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.home import configure_environment
from salience.logs import setup_logging

configure_environment()
setup_logging()  # before vLLM is imported: its processes log quietly too

from aiohttp import web  # noqa: E402

from salience.core.engine.engine import Engine  # noqa: E402
from salience.core.engine.requests import SamplingOptions  # noqa: E402
from salience.core.engine.settings import EngineSettings  # noqa: E402
from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model  # noqa: E402
from salience.core.serving.status import ServerStatus  # noqa: E402
from salience.http_app import make_app  # noqa: E402
from salience.lmtp.client import LmtpClient  # noqa: E402
from salience.lmtp.session import LmtpConfig  # noqa: E402
from tools.harness import HOST, Report, arguments, listens, prompts, rotations, run_main, say, serve  # noqa: E402
from tools.lmql_env import server_python  # noqa: E402


async def run_direct(engine: Engine, batch: list[list[int]], tokens: int, bias: dict[int, float]) -> int:
    async def one(prompt: list[int]) -> int:
        options = SamplingOptions(max_tokens=tokens, temperature=0.0, logit_bias=bias, logprobs=1)
        return sum([1 async for _ in engine.generate(prompt, options)])

    return sum(await asyncio.gather(*map(one, batch)))


async def run_lmtp(url: str, model: str, batch: list[list[int]], tokens: int, bias: dict[int, float]) -> int:
    client = await LmtpClient.connect(url)
    try:

        async def one(prompt: list[int]) -> int:
            fields = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "top_logprobs": 1}
            stream = client.stream("GENERATE", logit_bias={str(t): b for t, b in bias.items()}, **fields)
            return sum([1 async for payload in stream if "token" in payload])

        return sum(await asyncio.gather(*map(one, batch)))
    finally:
        await client.close()


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--model", type=Path, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--lmql", action="store_true", help="also measure `lmql serve-model` on the same model")
    args = parser.parse_args()
    model = args.model or ensure_default_model()
    name = DEFAULT_MODEL_NAME if args.model is None else model.name
    counts = [int(n) for n in args.streams.split(",")]
    report = Report("bench_lmtp", args)
    samples = report.samples

    say(f"loading {name} ...")
    engine = await Engine.start(EngineSettings(model=model, served_model_name=name, max_model_len=2048))
    bias = {engine.tokenizer.eos_token_id: -100.0}
    status = ServerStatus(name)
    status.ready(engine)
    runner = web.AppRunner(make_app(status, LmtpConfig()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"ws://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"
    kinds = {
        "engine": lambda batch: run_direct(engine, batch, args.tokens, bias),
        "LMTP": lambda batch: run_lmtp(url, name, batch, args.tokens, bias),
    }

    async def measure(kind: str, n: int, batch: list[list[int]]) -> None:
        started = time.perf_counter()
        produced = await kinds[kind](batch)
        seconds = time.perf_counter() - started
        assert produced == n * args.tokens, f"{kind}: {produced} tokens, expected {n * args.tokens}"
        samples.add(f"N={n} {kind:6} {produced / seconds:7.1f} tok/s", {f"N={n} {kind} s": seconds})

    for n in counts:
        batch = prompts(n, args.prompt_tokens, engine.vocab_size - 100)
        for _, kind in rotations(list(kinds), args.repeats):
            await measure(kind, n, batch)
    if args.lmql:  # started once Salience's rounds are done, and alone on the cores then
        command = [str(server_python()), "-m", "lmql.cli", "serve-model", str(model), "--static", "--port", "{port}"]
        with ExitStack() as stack:  # started in a thread: the engine's event loop keeps running
            lmql = serve("lmql serve-model", command, probe=listens, timeout=600)
            lmql_url = f"http://{HOST}:{(await asyncio.to_thread(stack.enter_context, lmql)).port}/"
            await run_lmtp(lmql_url, str(model), prompts(1, 8, engine.vocab_size - 100), 2, bias)  # load, warm up
            kinds["lmql serve-model"] = lambda batch: run_lmtp(lmql_url, str(model), batch, args.tokens, bias)
            for n in counts:
                batch = prompts(n, args.prompt_tokens, engine.vocab_size - 100)
                for _ in range(args.repeats):
                    await measure("lmql serve-model", n, batch)
    await runner.cleanup()
    engine.shutdown()

    columns = [("streams", "{}"), *((f"{kind} tok/s", "{:.1f}") for kind in kinds), ("LMTP / engine", "{:.3f}")]
    if args.lmql:
        columns.append(("Salience / LMQL", "{:.2f}"))
    table = report.table(
        f"{name}, prompt {args.prompt_tokens} tokens, {args.tokens} tokens per stream, median of {args.repeats}",
        *columns,
    )
    for n in counts:
        rates = {kind: n * args.tokens / samples.median(f"N={n} {kind} s") for kind in kinds}
        ratios = [rates["LMTP"] / rates["engine"]]
        if args.lmql:
            ratios.append(rates["LMTP"] / rates["lmql serve-model"])
        table.add(n, *rates.values(), *ratios)
    report.emit()


if __name__ == "__main__":
    run_main(main())
