"""What a parallel layout costs with readouts on: tokens/s for TP=1, TP=2, PP=2 and DP=2, one run.

Each layout starts the engine on an 8-head twin of the default model (`even_heads_twin`: the
default model's 9 heads allow no TP=2) with the built-in concept set (compiled,
unless --eager), runs N concurrent greedy streams (P-token prompts, M tokens each, EOS masked)
that ask for the readout of every generated token, and shuts the engine down before the next
layout starts. Each layout measures `--repeats` batches, each with prompts of its own (no
prefix-cache hits); prints the median tokens/s per layout and the ratio against TP=1.

On the two CPU cores of the development machine TP=2, PP=2 and DP=2 give each rank (or engine)
one core where TP=1's single worker has both, so the ratios measure communication and scheduling overhead
more than speedup; docs/scaling.md says what they imply for real nodes.

    flock /tmp/salience-cpu.lock .venv/bin/python -m tools.bench_scale [--streams 8] [--tokens 64] [--eager]
        [--repeats 3] [--json PATH]

The layouts are not rotated within a round: each starts its own engines on the same cores, so
they run one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

if not __package__:  # run as `python tools/bench_scale.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.harness import Report, Samples, arguments, run_main, say

LAYOUTS = {
    "TP=1": {},
    "TP=2": {"tensor_parallel_size": 2},
    "PP=2": {"pipeline_parallel_size": 2},
    "DP=2": {"data_parallel_size": 2},
}


def even_heads_twin(model: Path) -> Path:
    """The default model with 8 query heads and 2 KV heads, its attention weights sliced to fit.

    Its 9 query and 3 KV heads divide by no TP size above 1, and vLLM refuses TP=2. The twin has
    the same hidden size, layers, MLPs and embeddings, hence the same concept set, and costs per
    token what the default model does less one query head of nine and one KV head of three. Its
    outputs mean nothing; every layout runs it, so the ratios compare like with like.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from salience.core.models.atomic import build_folder_once
    from salience.core.models.home import salience_home

    def build(out: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        head_dim = config["head_dim"]
        weights = load_file(str(model / "model.safetensors"))
        for name, tensor in weights.items():
            rows = {"q_proj": 8, "k_proj": 2, "v_proj": 2}.get(name.split(".")[-2])
            if rows is not None:
                weights[name] = tensor[: rows * head_dim].contiguous()
            elif name.endswith("o_proj.weight"):
                weights[name] = tensor[:, : 8 * head_dim].contiguous()
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        config |= {"num_attention_heads": 8, "num_key_value_heads": 2}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        for other in model.iterdir():
            if other.name not in ("config.json", "model.safetensors"):
                shutil.copy(other, out / other.name)

    return build_folder_once(salience_home() / "bench-models" / f"{model.name}-8-heads", build)


async def measure(name: str, layout: dict, args: argparse.Namespace, samples: Samples) -> None:
    """Start seconds and generated tokens/s of each batch, for one layout, into `samples`."""
    from salience.core.engine.engine import Engine
    from salience.core.engine.requests import Probes, SamplingOptions
    from salience.core.engine.settings import EngineSettings
    from salience.core.models.default_model import ensure_default_model
    from salience.core.probes.concepts import ConceptSet
    from salience.core.serving.default_concepts import default_concepts

    default = ensure_default_model()
    concepts = ConceptSet.load(default_concepts(default))
    model = even_heads_twin(default)
    concepts.check_model(model)
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

        async def stream(i: int, batch: int) -> int:
            prompt = [1, *((7 * j + 31 * i + 997 * batch) % 40000 + 100 for j in range(args.prompt - 1))]
            generation = engine.generate(
                prompt, options, probes=Probes(readout_ranges=[(len(prompt), len(prompt) + args.tokens)])
            )
            events = [e async for e in generation]
            assert all(e.readout is not None for e in events), f"{name}: a token without its readout"
            return len(events)

        await asyncio.gather(*(stream(i, -1) for i in range(2)))  # warm: first requests of each batch shape
        samples.series[f"{name} start s"] = [start_seconds]
        say(f"{name}: started in {start_seconds:.0f} s")
        for batch in range(args.repeats):
            began = time.monotonic()
            tokens = sum(await asyncio.gather(*(stream(i, batch) for i in range(args.streams))))
            rate = tokens / (time.monotonic() - began)
            samples.add(f"{name} {rate:.1f} tokens/s", {f"{name} tok/s": rate})
    finally:
        engine.shutdown()


async def main(args: argparse.Namespace) -> int:
    report = Report("bench_scale", args)
    names = args.layouts.split(",")
    for name in names:
        await measure(name, LAYOUTS[name], args, report.samples)
    rates = {name: report.samples.median(f"{name} tok/s") for name in names}
    base = rates.get("TP=1")
    table = report.table(
        f"{args.streams} streams x {args.tokens} tokens, readout of every generated token, median of {args.repeats}, "
        f"{'eager' if args.eager else 'compiled'}",
        ("layout", ""),
        ("tokens/s", "{:.1f}"),
        ("vs TP=1", "{:.2f}"),
    )
    for name, rate in rates.items():
        table.add(name, rate, rate / base if base else None)
    report.emit()
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = arguments(__doc__)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated, of " + ", ".join(LAYOUTS))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    parser.add_argument("--eager", action="store_true")
    return parser.parse_args(argv)


if __name__ == "__main__":
    from salience.core.models.home import configure_environment

    configure_environment()  # before anything imports vllm or torch
    sys.exit(run_main(main(parse(sys.argv[1:]))))
