"""LMTP throughput: the WebSocket against the core engine, and against `lmql serve-model`.

One engine, one run: for each stream count N, N concurrent streams of M tokens go
(a) straight to the core engine and (b) through Salience's LMTP WebSocket, in
alternating order, repeated; the medians give the ratio (b)/(a). With --lmql the
same requests then go to LMQL's own server (transformers backend, its own
environment) on the same model. Every stream masks EOS with logit_bias, which
all three honour, so each produces exactly M tokens.

    .venv/bin/python tools/bench_lmtp.py [--streams 1,4,16] [--tokens 64] [--lmql]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
from salience.lmtp.app import make_app  # noqa: E402
from salience.lmtp.client import LmtpClient  # noqa: E402
from salience.lmtp.session import LmtpConfig  # noqa: E402


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[1, *((97 * i + 31 * j) % (vocab - 100) + 50 for j in range(length - 1))] for i in range(n)]


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


async def timed(work) -> tuple[float, int]:
    started = time.perf_counter()
    produced = await work
    return time.perf_counter() - started, produced


def lmql_server_python() -> Path:
    """LMQL 0.7.3 with its transformers backend (CPU torch), in an environment of its own."""
    from salience.core.models.atomic import build_folder_once
    from salience.core.models.home import salience_home

    def build(folder: Path) -> None:
        import venv

        venv.EnvBuilder(with_pip=True).create(folder)
        pip = [folder / "bin" / "python", "-m", "pip", "install", "--disable-pip-version-check"]
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run(
            [*pip, "-c", "/dev/stdin", "lmql==0.7.3", "transformers==4.57.6", "accelerate"],
            input=b"torch==2.13.0\n",
            check=True,
        )

    return build_folder_once(salience_home() / "venvs" / "lmql0.7.3-server-torch2.13.0", build) / "bin" / "python"


async def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(1)
    raise TimeoutError(f"nothing listens on {port} after {timeout:.0f} s")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument("--streams", default="1,4,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lmql", action="store_true", help="also measure `lmql serve-model` on the same model")
    args = parser.parse_args()
    model = args.model or ensure_default_model()
    name = DEFAULT_MODEL_NAME if args.model is None else model.name
    counts = [int(n) for n in args.streams.split(",")]

    print(f"loading {name} ...", file=sys.stderr)
    engine = await Engine.start(EngineSettings(model=model, served_model_name=name, max_model_len=2048))
    eos = engine.tokenizer.eos_token_id
    bias = {eos: -100.0}
    status = ServerStatus(name)
    status.ready(engine)
    runner = web.AppRunner(make_app(status, LmtpConfig()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"ws://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/"

    rows = []
    for n in counts:
        batch = prompts(n, args.prompt_tokens, engine.vocab_size)
        direct, lmtp = [], []
        for repeat in range(args.repeats):
            order = [("direct", direct), ("lmtp", lmtp)][:: 1 if repeat % 2 == 0 else -1]
            for kind, times in order:
                work = (
                    run_direct(engine, batch, args.tokens, bias)
                    if kind == "direct"
                    else run_lmtp(url, name, batch, args.tokens, bias)
                )
                seconds, produced = await timed(work)
                assert produced == n * args.tokens, f"{kind}: {produced} tokens, expected {n * args.tokens}"
                times.append(seconds)
                print(f"  N={n} {kind:6} run {repeat + 1}: {produced / seconds:7.1f} tok/s", file=sys.stderr)
        total = n * args.tokens
        rows.append((n, total / statistics.median(direct), total / statistics.median(lmtp)))

    lmql_rows = {}
    if args.lmql:
        python = lmql_server_python()
        port = 18000 + os.getpid() % 1000
        server = subprocess.Popen(
            [python, "-m", "lmql.cli", "serve-model", str(model), "--static", "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            await wait_for_port(port, 600)
            lmql_url = f"http://127.0.0.1:{port}/"
            await run_lmtp(lmql_url, str(model), prompts(1, 8, engine.vocab_size), 2, bias)  # load and warm up
            for n in counts:
                batch = prompts(n, args.prompt_tokens, engine.vocab_size)
                times = []
                for repeat in range(args.repeats):
                    seconds, produced = await timed(run_lmtp(lmql_url, str(model), batch, args.tokens, bias))
                    times.append(seconds)
                    print(f"  N={n} lmql   run {repeat + 1}: {produced / seconds:7.1f} tok/s", file=sys.stderr)
                lmql_rows[n] = n * args.tokens / statistics.median(times)
        finally:
            server.terminate()
            server.wait()

    await runner.cleanup()
    engine.shutdown()
    print(f"\n{name}, prompt {args.prompt_tokens} tokens, {args.tokens} tokens per stream, median of {args.repeats}")
    header = f"{'streams':>7} {'engine tok/s':>13} {'LMTP tok/s':>11} {'LMTP/engine':>12}"
    print(header + (f" {'lmql serve-model tok/s':>23} {'Salience/LMQL':>14}" if lmql_rows else ""))
    for n, direct_rate, lmtp_rate in rows:
        line = f"{n:>7} {direct_rate:>13.1f} {lmtp_rate:>11.1f} {lmtp_rate / direct_rate:>12.3f}"
        if n in lmql_rows:
            line += f" {lmql_rows[n]:>23.1f} {lmtp_rate / lmql_rows[n]:>14.2f}"
        print(line)


if __name__ == "__main__":
    asyncio.run(main())
