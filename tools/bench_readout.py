"""What readouts cost a user: `salience serve` with readouts against the fastest server without.

Up to five servers on the default model, started once, driven over LMTP in one run:

- `--no-readouts`: the fastest configuration a user could pick without readouts (compiled);
- the default: compiled, readout taps on every layer of the built-in concept set, and every
  generated token asks for its readout;
- `--eager`: readouts in eager mode (the path before readouts were compiled);
- `--spare-concepts 0`: readouts without the spare columns live concepts take (what those
  16 zero columns cost);
- `--sae DIR`: readouts plus a sparse autoencoder's encoder at a middle layer (docs/features.md),
  driven with readouts and the top 32 features on every generated token. DIR is `--sae` here, by
  default a random top-k SAE of the shape tools/train_sae.py makes (8x, k = 32): the cost
  depends on the shape only.

The default server is also driven without asking for readouts ("idle": what the taps and the
steering code cost inside the graph, apart from moving rows out), and four ways with them: raw
readouts, readouts as calibrated probabilities, raw readouts with one `flag` monitor per concept
(p > 0.5 at its recommended layer), and raw readouts plus the residual rows of one middle layer
on every generated token (docs/residuals.md). For each stream count N, N concurrent streams (greedy, P-token prompts, M
tokens each, EOS masked) go each way in rotating order, repeated; the medians give tokens/s, and
the medians of each round's ratios (a drift over the run cancels within a round) the ratios
against the first way (`--no-readouts` by default) and a few ratios between ways. Servers
are started one after another (a first start compiles, which is reported) and then idle while
another is measured; every idle engine spins on the cores, so `--ways` picks fewer (each server
a way needs is started, and the default one always) for a quieter comparison.

    .venv/bin/python tools/bench_readout.py [--streams 1,8,16] [--tokens 64] [--repeats 3] [--warm]
        [--sae DIR] [--ways fastest,idle,readouts,probabilities,monitors,eager,unspared,residual,sae]

`--warm` skips the start with empty compile caches (the first start's cost).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from salience.lmtp.client import LmtpClient

CONFIGS = {  # the servers, by key: name and flags
    "fastest": ("compiled, no readouts", ["--no-readouts"]),
    "default": ("default: compiled + readouts", []),
    "eager": ("eager + readouts", ["--eager"]),
    "unspared": ("readouts, no spare columns", ["--spare-concepts", "0"]),
    "sae": ("readouts + SAE", ["--sae"]),  # the folder is appended
}
# The ways to drive them, by key: the server and whether every generated token asks for readouts.
WAYS = {
    "fastest": ("fastest", False),
    "idle": ("default", False),
    "readouts": ("default", True),
    "probabilities": ("default", True),
    "monitors": ("default", True),
    "eager": ("eager", True),
    "unspared": ("unspared", True),
    "residual": ("default", True),
    "sae": ("sae", True),
}
# Ratios between two ways besides "/ first": (title, numerator, denominator).
EXTRA = (
    ("readouts / taps idle", "readouts", "idle"),
    ("monitors / readouts", "monitors", "readouts"),
    ("readouts / no spare columns", "readouts", "unspared"),
    ("with residual rows / readouts", "residual", "readouts"),
    ("with SAE / readouts", "sae", "readouts"),
)


@dataclass
class Server:
    name: str
    flags: list[str]
    port: int
    process: subprocess.Popen | None = None
    start_seconds: float = 0.0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"


async def start(server: Server, model_name: str, timeout: float = 1800) -> None:
    """Start one server and wait for /health; prints a progress line every 30 s."""
    command = [sys.executable, "-m", "salience", "serve", "--lmtp-port", str(server.port), "--no-grpc"]
    command += ["--max-model-len", "2048", *server.flags]
    env = os.environ | server.env
    server.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    started = time.monotonic()
    last = started
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - started < timeout:
            if server.process.poll() is not None:
                raise RuntimeError(f"{server.name}: the server exited with {server.process.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{server.port}/health") as response:
                    if response.status == 200:
                        server.start_seconds = time.monotonic() - started
                        print(f"  {server.name}: ready in {server.start_seconds:.0f} s", file=sys.stderr)
                        return
            if time.monotonic() - last > 30:
                last = time.monotonic()
                print(f"  {server.name}: starting, {last - started:.0f} s so far", file=sys.stderr)
            await asyncio.sleep(1)
    raise TimeoutError(f"{server.name}: not ready after {timeout:.0f} s")


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=120)


@dataclass
class Way:
    """One way of driving a server: whether every generated token asks for its readout, the fields
    every GENERATE adds, and what it measured."""

    key: str
    name: str
    server: Server
    reads: bool
    fields: dict = field(default_factory=dict)
    rates: dict[int, list[float]] = field(default_factory=dict)


def ways(keys: list[str], running: dict[str, Server], concepts: list[str], layers: list[int]) -> list[Way]:
    monitors = [{"concept": name, "above": 0.5, "action": "flag"} for name in concepts]
    middle = layers[len(layers) // 2]
    described = {
        "fastest": ("compiled, no readouts", {}),
        "idle": ("taps idle (none asked)", {}),
        "readouts": ("readouts", {}),
        "probabilities": ("probabilities", {"readout_format": "probability"}),
        "monitors": (f"readouts + {len(monitors)} monitors", {"monitors": monitors}),
        "eager": ("eager + readouts", {}),
        "unspared": ("readouts, no spare columns", {}),
        # their ranges: each stream's generated tokens (run)
        "residual": (f"readouts + residual rows (layer {middle})", {"residual": {"layers": [middle]}}),
        "sae": ("readouts + SAE top-32 features", {"features": {"k": 32}}),
    }
    out = []
    for key in keys:
        server, reads = WAYS[key]
        name, fields = described[key]
        out.append(Way(key, name, running[server], reads, fields))
    return out


@contextlib.asynccontextmanager
async def servers(
    configs: dict[str, tuple[str, list[str]]], model_name: str, cache: str, warm: bool
) -> AsyncIterator[tuple[dict[str, Server], float]]:
    """The servers, ready; and how long the default one took to start with empty compile caches
    (its measured start then reuses what that start compiled), unless `warm`."""
    base = 19000 + os.getpid() % 500 * 4
    running = {key: Server(name, flags, base + i) for i, (key, (name, flags)) in enumerate(configs.items())}
    fresh = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/torchinductor", "VLLM_CACHE_ROOT": f"{cache}/vllm"}
    cold = Server("default, empty compile cache", [], base + len(running), env=fresh)
    if not warm:
        running["default"].env = fresh
    try:
        if not warm:
            await start(cold, model_name)
            stop(cold)
        for server in running.values():
            await start(server, model_name)
        yield running, cold.start_seconds
    finally:
        for server in [cold, *running.values()]:
            stop(server)


def prompts(n: int, length: int) -> list[list[int]]:
    return [[1, *((97 * i + 31 * j) % 40000 + 50 for j in range(length - 1))] for i in range(n)]


async def run(way: Way, model: str, batch: list[list[int]], tokens: int, eos: int) -> tuple[float, int, int]:
    """Seconds for the batch, tokens received, readouts received."""
    client = await LmtpClient.connect(way.server.url)
    try:

        async def one(prompt: list[int]) -> tuple[int, int]:
            fields = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, **way.fields}
            generated_range = [[len(prompt), len(prompt) + tokens]]
            if way.reads:
                fields["readout"] = generated_range
            for rows in ("residual", "features"):
                if rows in fields:
                    fields[rows] = {**fields[rows], "ranges": generated_range}
            payloads = [p async for p in client.stream("GENERATE", logit_bias={str(eos): -100.0}, **fields)]
            generated = [p for p in payloads if "token" in p and not p.get("prompt")]
            for rows in ("residual", "features"):
                if rows in fields:
                    assert all(rows in p for p in generated), f"{way.name}: a token without its {rows}"
            return len(generated), sum(p.get("readout") is not None for p in generated)

        started = time.perf_counter()
        counts = await asyncio.gather(*map(one, batch))
        return time.perf_counter() - started, sum(c[0] for c in counts), sum(c[1] for c in counts)
    finally:
        await client.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="no start with empty compile caches")
    parser.add_argument("--sae", help="the SAE folder (default: a random 8x top-32 SAE at layer 15)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"the ways to drive, of {','.join(WAYS)}")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    keys = args.ways.split(",")
    if unknown := [key for key in keys if key not in WAYS]:
        parser.error(f"unknown ways {unknown}; known: {', '.join(WAYS)}")

    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.home import configure_environment

    configure_environment()
    eos = _eos(ensure_default_model())
    with tempfile.TemporaryDirectory() as cache:
        needed = {WAYS[key][0] for key in keys} | {"default"}  # the default one answers the manifest
        configs = {key: config for key, config in CONFIGS.items() if key in needed}
        if "sae" in configs:
            configs["sae"] = (configs["sae"][0], ["--sae", args.sae or _random_sae(Path(cache) / "sae")])
        print(f"starting {len(configs)} servers on the default model, one after another", file=sys.stderr)
        async with servers(configs, DEFAULT_MODEL_NAME, cache, args.warm) as (running, cold):
            client = await LmtpClient.connect(running["default"].url)
            manifest = (await client.request("MODEL_INFO"))["model_info"]["readout_manifest"]
            await client.close()
            driven = ways(keys, running, manifest["concepts"], manifest["layers"])
            await measure(driven, counts, args, eos)
    report(running, driven, counts, args, cold)


async def measure(driven: list[Way], counts: list[int], args: argparse.Namespace, eos: int) -> None:
    from salience.core.models.default_model import DEFAULT_MODEL_NAME

    for way in driven:  # the first request of each pays for lazy initialisation
        await run(way, DEFAULT_MODEL_NAME, prompts(1, 8), 4, eos)
    for n in counts:
        batch = prompts(n, args.prompt_tokens)
        for repeat in range(args.repeats):
            shift = repeat % len(driven)
            for way in driven[shift:] + driven[:shift]:
                seconds, produced, read = await run(way, DEFAULT_MODEL_NAME, batch, args.tokens, eos)
                expected = n * args.tokens
                assert produced == expected, f"{way.name}: {produced} tokens, expected {expected}"
                if way.reads:
                    assert read == expected, f"{way.name}: {read} readouts, expected {expected}"
                way.rates.setdefault(n, []).append(produced / seconds)
                print(f"  N={n:<3} {way.name:30} run {repeat + 1}: {produced / seconds:7.1f} tok/s", file=sys.stderr)


def report(
    running: dict[str, Server], driven: list[Way], counts: list[int], args: argparse.Namespace, cold: float
) -> None:
    from salience.core.models.default_model import DEFAULT_MODEL_NAME

    print(
        f"\n{DEFAULT_MODEL_NAME}, LMTP, greedy, {args.prompt_tokens}-token prompts, {args.tokens} tokens per stream, "
        f"median of {args.repeats}; readouts on every generated token, every layer"
    )
    by_key = {w.key: w for w in driven}
    extra = [(title, by_key[a], by_key[b]) for title, a, b in EXTRA if a in by_key and b in by_key]
    names = " | ".join(f"{w.name} tok/s" for w in driven)
    ratios = " | ".join(f"{w.name} / {driven[0].name}" for w in driven[1:])
    titles = "".join(f" | {title}" for title, _, _ in extra)
    print(f"\n| streams | {names} | {ratios}{titles} |")
    print("|---:" * (2 * len(driven) + len(extra)) + "|")
    for n in counts:
        rates = [statistics.median(w.rates[n]) for w in driven]
        cells = (
            " | ".join(f"{r:.1f}" for r in rates)
            + " | "
            + " | ".join(f"{paired(w.rates[n], driven[0].rates[n]):.2f}" for w in driven[1:])
        )
        more = "".join(f" | {paired(a.rates[n], b.rates[n]):.2f}" for _, a, b in extra)
        print(f"| {n} | {cells}{more} |")
    starts = ", ".join(f"{s.name} {s.start_seconds:.0f} s" for s in running.values())
    first = f"default with empty compile caches {cold:.0f} s; then " if cold else ""
    print(f"\nstart to ready: {first}{starts}")


def paired(a: list[float], b: list[float]) -> float:
    """The median over rounds of a / b: each round times every way once, back to back, so a drift
    in the machine's speed over the run (a neighbour, thermal state) cancels within a round."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _random_sae(folder: Path) -> str:
    """A top-k SAE of tools/train_sae.py's shape at layer 15 of the default model, random weights."""
    import torch

    from salience.core.features.sae import save_sae

    generator = torch.Generator().manual_seed(0)
    decoder = torch.randn(8 * 576, 576, generator=generator)
    decoder /= decoder.norm(dim=1, keepdim=True)
    b_enc = torch.zeros(8 * 576)
    save_sae(
        folder,
        architecture="topk",
        layer=15,
        W_enc=decoder.T.contiguous(),
        b_enc=b_enc,
        W_dec=decoder,
        b_dec=torch.zeros(576),
        k=32,
        model_name="SmolLM2-135M-Instruct",
    )
    return str(folder)


def _eos(model) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["eos_token_id"])


if __name__ == "__main__":
    asyncio.run(main())
