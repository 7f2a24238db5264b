"""What readouts cost a user: `salience serve` with readouts against the fastest server without.

Up to five servers on the default model, started once, driven over LMTP in one run:

- `--no-readouts`: the fastest configuration a user could pick without readouts (compiled);
- the default: compiled, readout taps on every layer of the built-in concept set, and every
  generated token asks for its readout;
- `--eager`: readouts in eager mode (the path before readouts were compiled);
- `--spare-concepts 0`: readouts without the spare columns live concepts take (what those
  16 zero columns cost);
- `--point P` (default mlp_out): the built-in concept set's vectors read at another hook point of
  each layer (docs/readouts.md), its taps around a module inside the layer instead of the layer;
- `--patch-points all`: readouts plus a patch tap at every point of every layer (docs/patching.md),
  driven with readouts and no patch: what a server that can patch costs a request that does not;
- `--sae DIR`: readouts plus a sparse autoencoder's encoder at a middle layer (docs/features.md),
  driven with readouts and the top 32 features on every generated token. DIR is `--sae` here, by
  default a random top-k SAE of the shape tools/train_sae.py makes (8x, k = 32): the cost
  depends on the shape only.

The default server is also driven without asking for readouts ("idle": what the taps and the
steering code cost inside the graph, apart from moving rows out), and four ways with them: raw
readouts (as JSON numbers, and as float32 in base64, `"readout_encoding": "f32"`: "f32"), readouts
as calibrated probabilities (and as f32), raw readouts with one `flag` monitor per concept
(p > 0.5 at its recommended layer), and raw readouts plus the residual rows of one middle layer
on every generated token (docs/residuals.md). For each stream count N, N concurrent streams (greedy, P-token prompts, M
tokens each, EOS masked) go each way in rotating order, repeated; the medians give tokens/s, and
the medians of each round's ratios (a drift over the run cancels within a round) the ratios
against the first way (`--no-readouts` by default) and a few ratios between ways. Servers
are started one after another (a first start compiles, which is reported) and then idle while
another is measured (an idle engine waits without spinning: 1% of a core); `--ways` picks fewer
(each server a way needs is started, and the default one always), which start sooner and hold
less memory.

    .venv/bin/python -m tools.bench_readout [--model DIR] [--streams 1,8,16] [--tokens 64] [--repeats 3]
        [--warm] [--sae DIR] [--json PATH]
        [--point P] [--ways fastest,idle,readouts,f32,probabilities,probabilities-f32,monitors,eager,unspared,
        residual,sae,point,patching]

`--warm` skips the start with empty compile caches (the first start's cost). `--model DIR` measures
another model (its default concept set, built once by its first start; the `sae` way there needs
`--sae DIR`, as the random SAE has the default model's shape).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as `python tools/bench_readout.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.points import POINTS
from salience.lmtp.client import LmtpClient
from salience.lmtp.codec import readout_values
from tools.harness import (
    Report,
    Samples,
    Server,
    arguments,
    fresh_caches,
    picked,
    prompts,
    rotations,
    salience_serve,
    say,
    serve,
)

CONFIGS = {  # the servers, by key: name and flags
    "fastest": ("compiled, no readouts", ["--no-readouts"]),
    "default": ("default: compiled + readouts", []),
    "eager": ("eager + readouts", ["--eager"]),
    "unspared": ("readouts, no spare columns", ["--spare-concepts", "0"]),
    "sae": ("readouts + SAE", ["--sae"]),  # the folder is appended
    "point": ("readouts at another point", ["--concepts"]),  # the set's file is appended
    "patching": ("readouts + patch taps", ["--patch-points", "all"]),
}
# The ways to drive them, by key: the server and whether every generated token asks for readouts.
WAYS = {
    "fastest": ("fastest", False),
    "idle": ("default", False),
    "readouts": ("default", True),
    "f32": ("default", True),
    "probabilities": ("default", True),
    "probabilities-f32": ("default", True),
    "monitors": ("default", True),
    "eager": ("eager", True),
    "unspared": ("unspared", True),
    "residual": ("default", True),
    "sae": ("sae", True),
    "point": ("point", True),
    "patching": ("patching", True),
}
WARM_BATCHES = 4  # batches of the most streams each way runs before the rounds
# Ratios between two ways besides "/ first": (title, numerator, denominator).
EXTRA = (
    ("readouts / taps idle", "readouts", "idle"),
    ("f32 / JSON readouts", "f32", "readouts"),
    ("monitors / readouts", "monitors", "readouts"),
    ("readouts / no spare columns", "readouts", "unspared"),
    ("with residual rows / readouts", "residual", "readouts"),
    ("with SAE / readouts", "sae", "readouts"),
    ("at another point / resid_post", "point", "readouts"),
    ("with patch taps / readouts", "patching", "readouts"),
)


@dataclass
class Way:
    """One way of driving a server: whether every generated token asks for its readout, the fields
    every GENERATE adds, and what it measured."""

    key: str
    name: str
    server: Server
    reads: bool
    fields: dict = field(default_factory=dict)


def ways(keys: list[str], running: dict[str, Server], concepts: list[str], layers: list[int], point: str) -> list[Way]:
    monitors = [{"concept": name, "above": 0.5, "action": "flag"} for name in concepts]
    middle = layers[len(layers) // 2]
    described = {
        "fastest": ("compiled, no readouts", {}),
        "idle": ("taps idle (none asked)", {}),
        "readouts": ("readouts", {}),
        "f32": ("readouts as f32", {"readout_encoding": "f32"}),
        "probabilities": ("probabilities", {"readout_format": "probability"}),
        "probabilities-f32": ("probabilities as f32", {"readout_format": "probability", "readout_encoding": "f32"}),
        "monitors": (f"readouts + {len(monitors)} monitors", {"monitors": monitors}),
        "eager": ("eager + readouts", {}),
        "unspared": ("readouts, no spare columns", {}),
        # their ranges: each stream's generated tokens (run)
        "residual": (f"readouts + residual rows (layer {middle})", {"residual": {"layers": [middle]}}),
        "sae": ("readouts + SAE top-32 features", {"features": {"k": 32}}),
        "point": (f"readouts at {point}", {}),
        "patching": ("readouts, --patch-points all (none patched)", {}),
    }
    out = []
    for key in keys:
        server, reads = WAYS[key]
        name, fields = described[key]
        out.append(Way(key, name, running[server], reads, fields))
    return out


def start(
    stack: ExitStack, configs: dict[str, tuple[str, list[str]]], cache: str, warm: bool, model: list[str]
) -> tuple[dict[str, Server], float]:
    """The servers, ready, one after another (stopped when `stack` closes); and how long the default
    one took to start with empty compile caches (its measured start then reuses what that start
    compiled), unless `warm`."""
    fresh = fresh_caches(cache)
    cold = 0.0
    if not warm:
        first_start = salience_serve("--max-model-len", "2048", *model)
        with serve("default, empty compile cache", first_start, env=fresh) as first:
            cold = first.ready
    running = {}
    for key, (name, flags) in configs.items():
        env = fresh if key == "default" and not warm else None
        command = salience_serve("--max-model-len", "2048", *model, *flags)
        running[key] = stack.enter_context(serve(name, command, env=env))
    return running, cold


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
            # As a client uses them: numbers, whichever encoding carried them.
            read = [readout_values(p["readout"]) for p in generated if p.get("readout") is not None]
            return len(generated), len(read)

        started = time.perf_counter()
        counts = await asyncio.gather(*map(one, batch))
        return time.perf_counter() - started, sum(c[0] for c in counts), sum(c[1] for c in counts)
    finally:
        await client.close()


async def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--streams", default="1,8,16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--warm", action="store_true", help="no start with empty compile caches")
    parser.add_argument("--sae", help="the SAE folder (default: a random 8x top-32 SAE at layer 15)")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"the ways to drive, of {','.join(WAYS)}")
    parser.add_argument("--model", type=Path, help="a model folder (default: the embedded default model)")
    parser.add_argument("--point", default="mlp_out", choices=POINTS, help="the point way's hook point")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]
    keys = picked(parser, args.ways, WAYS, "ways")
    if args.model and "sae" in keys and not args.sae:
        parser.error("the sae way on --model needs --sae DIR: the random SAE has the default model's shape")

    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.home import configure_environment

    configure_environment()
    eos = _eos(args.model or ensure_default_model())
    args.name = str(args.model) if args.model else DEFAULT_MODEL_NAME  # as the servers call it
    model = ["--model", str(args.model)] if args.model else []
    report = Report("bench_readout", args)
    with tempfile.TemporaryDirectory() as cache, ExitStack() as stack:
        needed = {WAYS[key][0] for key in keys} | {"default"}  # the default one answers the manifest
        configs = {key: config for key, config in CONFIGS.items() if key in needed}
        if "sae" in configs:
            configs["sae"] = (configs["sae"][0], ["--sae", args.sae or _random_sae(Path(cache) / "sae")])
        if "point" in configs:
            at = await asyncio.to_thread(_at_point, args.model or ensure_default_model(), args.point, Path(cache))
            configs["point"] = (configs["point"][0], ["--concepts", at])
        say(f"starting {len(configs)} servers on {args.name}, one after another")
        running, cold = start(stack, configs, cache, args.warm, model)
        client = await LmtpClient.connect(running["default"].url)
        manifest = (await client.request("MODEL_INFO"))["model_info"]["readout_manifest"]
        await client.close()
        driven = ways(keys, running, manifest["concepts"], manifest["layers"], args.point)
        await measure(driven, counts, args, eos, report.samples)
    tabulate(report, running, driven, counts, args, cold)
    report.emit()


async def measure(driven: list[Way], counts: list[int], args: argparse.Namespace, eos: int, samples: Samples) -> None:
    # A fresh engine runs ~20% faster after a few batches than in its first (8 streams x 128
    # tokens: 8.4 s, then 7.8, 7.7, 7.2, 6.9, steady from there; 2026-11-27): rounds measured
    # before that compare engines at different points of it.
    warm = prompts(max(counts), args.prompt_tokens, 40000, batch=1)
    say(f"warming each engine with {WARM_BATCHES} batches of {max(counts)} streams")
    for _ in range(WARM_BATCHES):
        for way in driven:
            await run(way, args.name, warm, args.tokens, eos)
    for n in counts:
        batch = prompts(n, args.prompt_tokens, 40000)
        for _, way in rotations(driven, args.repeats):
            seconds, produced, read = await run(way, args.name, batch, args.tokens, eos)
            expected = n * args.tokens
            assert produced == expected, f"{way.name}: {produced} tokens, expected {expected}"
            if way.reads:
                assert read == expected, f"{way.name}: {read} readouts, expected {expected}"
            samples.add(
                f"N={n:<3} {way.name:30} {produced / seconds:7.1f} tok/s", {f"N={n} {way.key}": produced / seconds}
            )


def tabulate(
    report: Report,
    running: dict[str, Server],
    driven: list[Way],
    counts: list[int],
    args: argparse.Namespace,
    cold: float,
) -> None:
    samples = report.samples
    keys = {w.key for w in driven}
    extra = [(title, a, b) for title, a, b in EXTRA if a in keys and b in keys]
    table = report.table(
        f"{Path(args.name).name}, LMTP, greedy, {args.prompt_tokens}-token prompts, {args.tokens} tokens per stream, "
        f"median of {args.repeats}; readouts on every generated token, every layer",
        ("streams", "{}"),
        *((f"{w.name} tok/s", "{:.1f}") for w in driven),
        *((f"{w.name} / {driven[0].name}", "{:.2f}") for w in driven[1:]),
        *((title, "{:.2f}") for title, _, _ in extra),
        (f"the rounds' ratios to {driven[0].name}", ""),
    )
    for n in counts:
        rates = [samples.median(f"N={n} {w.key}") for w in driven]
        ratios = [samples.paired(f"N={n} {w.key}", f"N={n} {driven[0].key}") for w in driven[1:]]
        spread = "; ".join(
            " ".join(f"{r:.2f}" for r in samples.rounds(f"N={n} {w.key}", f"N={n} {driven[0].key}")) for w in driven[1:]
        )
        table.add(
            n, *rates, *ratios, *(samples.paired(f"N={n} {a}", f"N={n} {b}") for _, a, b in extra), spread or None
        )
    for key, server in running.items():
        samples.series[f"{key} ready s"] = [server.ready]
    starts = ", ".join(f"{s.name} {s.ready:.0f} s" for s in running.values())
    first = f"default with empty compile caches {cold:.0f} s; then " if cold else ""
    report.text(f"start to ready: {first}{starts}")


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


def _at_point(model: Path, point: str, folder: Path) -> str:
    """The model's built-in concept set with its vectors read at `point` of each layer: the same
    concepts, layers and columns, so only where the taps sit differs from the default server."""
    import dataclasses

    from salience.core.probes.concepts import ConceptSet
    from salience.core.serving.default_concepts import default_concepts

    path = folder / f"concepts-{point}.safetensors"
    dataclasses.replace(ConceptSet.load(default_concepts(model)), point=point).save(path)
    return str(path)


def _eos(model) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["eos_token_id"])


if __name__ == "__main__":
    asyncio.run(main())
