"""`salience serve`: its arguments, and loading what they name before the engine starts."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from pathlib import Path

from salience.auth import ADMIN_TOKEN_ENV, AUTH_TOKEN_ENV, token_from_environment
from salience.errors import InvalidArgument

__all__ = ["add_serve_parser", "run_serve"]


def _engine_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = value
    return key.replace("-", "_"), parsed


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="load a model and serve it")
    serve.add_argument("--model", help="Hugging Face model folder (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--served-model-name", help="name clients use (default: --model as given)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--lmtp-port", type=int, default=8080, help="LMTP WebSocket, /health and the page")
    serve.add_argument("--lmtp-tcp-port", type=int, help="also serve LMTP over plain TCP, one message per line")
    serve.add_argument(
        "--lmtp-max-message-bytes",
        type=int,
        default=16 * 2**20,
        help="largest LMTP message parsed; a larger one gets an error for its stream (default 16 MiB)",
    )
    serve.add_argument(
        "--lmtp-max-frame-bytes",
        type=int,
        default=256 * 2**20,
        help="largest LMTP message read at all; a larger one closes its connection (default 256 MiB)",
    )
    serve.add_argument("--grpc-port", type=int, default=50051, help="the salience.v1 gRPC service")
    serve.add_argument("--no-grpc", dest="grpc", action="store_false", help="serve no gRPC")
    serve.add_argument(
        "--metrics-port", type=int, help="also serve GET /metrics here, without auth (for a private network)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight streams may run after SIGTERM before they are cancelled",
    )
    serve.add_argument(
        "--model-alias", action="append", default=[], help="another model name clients may use (repeatable)"
    )
    serve.add_argument(
        "--auth-token",
        default=token_from_environment(),
        help=f"bearer token every client must present (default: ${AUTH_TOKEN_ENV}; unset: open)",
    )
    serve.add_argument(
        "--admin-token",
        default=token_from_environment(ADMIN_TOKEN_ENV),
        help=f"the operator's bearer token: it alone may define, delete and save live concepts (default: "
        f"${ADMIN_TOKEN_ENV}; unset: anyone on an open server, nobody on one with --auth-token)",
    )
    sessions = serve.add_argument_group("sessions")
    sessions.add_argument("--session-ttl", type=float, default=1800.0, help="seconds an idle session is kept")
    sessions.add_argument("--max-sessions", type=int, default=4096)
    sessions.add_argument(
        "--max-session-tokens", type=int, default=50_000_000, help="tokens stored across all sessions"
    )
    engine = serve.add_argument_group("engine")
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--dtype", help="model dtype (default: float32 on CPU, the model's own on GPU)")
    engine.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size on CPU (GiB)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--tensor-parallel-size", type=int, default=1)
    engine.add_argument(
        "--pipeline-parallel-size", type=int, default=1, help="pipeline stages, each holding some decoder layers"
    )
    engine.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas behind this server; each session stays on one (its prefix cache)",
    )
    engine.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        help="how vLLM runs its workers: processes on this machine (mp, the default) or a Ray cluster",
    )
    engine.add_argument(
        "--ray-address", help="the Ray cluster to join (e.g. 'auto' or 'HOST:6379'; implies the ray backend)"
    )
    engine.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    engine.add_argument("--max-logprobs", type=int, default=20, help="largest top-k a request may ask for")
    engine.add_argument("--max-images", type=int, default=16, help="vision-language models: images per session")
    mode = engine.add_mutually_exclusive_group()
    mode.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=True,
        help="run the model compiled, readouts included (the default): faster; the first start of a model "
        "and concept set compiles for minutes, later ones reuse the cache under $SALIENCE_HOME",
    )
    mode.add_argument(
        "--eager", dest="compile", action="store_false", help="run the model eagerly: starts sooner, runs slower"
    )
    engine.add_argument(
        "--multiprocess",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run vLLM's worker in its own process (default: in-process on CPU)",
    )
    engine.add_argument(
        "--engine-arg",
        action="append",
        type=_engine_arg,
        default=[],
        metavar="KEY=VALUE",
        help="any other vLLM engine argument (VALUE parsed as JSON when it is JSON)",
    )
    serve.add_argument(
        "--concepts", type=Path, help="concept set for readouts (default model: the built-in set, built once)"
    )
    serve.add_argument("--no-readouts", dest="readouts", action="store_false", help="no concept set, no readout taps")
    serve.add_argument(
        "--steering",
        type=Path,
        metavar="FILE",
        help="more directions to steer along: a concept set's format (docs/steering.md)",
    )
    serve.add_argument(
        "--no-steering", dest="steer", action="store_false", help="no steering: the concept set is read, never written"
    )
    serve.add_argument(
        "--spare-concepts",
        type=int,
        default=16,
        metavar="N",
        help="readout and steering columns for live concepts, defined while the server runs (docs/live-concepts.md)",
    )
    serve.add_argument(
        "--steer-vectors",
        type=int,
        default=16,
        metavar="N",
        help="steering columns for requests' own vectors: distinct vectors that can steer at once",
    )
    serve.add_argument(
        "--max-residual-rows",
        type=int,
        default=16384,
        metavar="N",
        help="residual rows (positions x layers) one request may ask for (docs/residuals.md)",
    )
    serve.add_argument(
        "--residual-memory",
        type=int,
        default=512,
        metavar="MIB",
        help="residual rows all requests may hold at once, in MiB of float32; requests beyond it wait",
    )
    serve.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="a sparse autoencoder in SAELens's format to read features of and steer along (docs/features.md)",
    )
    serve.add_argument(
        "--sae-top", type=int, default=32, metavar="N", help="features per token the graph keeps of each SAE"
    )
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run_serve(args: argparse.Namespace) -> int:
    from salience.core.engine.settings import EngineSettings
    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.folders import inspect_model_folder
    from salience.core.serving.sessions import SessionLimits
    from salience.lmtp.session import ConnectionLimits
    from salience.server import ServeOptions, serve

    # Checked first: a bad limit must not wait for the model.
    for flag, value in (("--spare-concepts", args.spare_concepts), ("--steer-vectors", args.steer_vectors)):
        if value < 0:
            raise InvalidArgument(f"{flag} must be 0 or more, got {value}")
    for flag, value in (
        ("--sae-top", args.sae_top),
        ("--max-residual-rows", args.max_residual_rows),
        ("--residual-memory", args.residual_memory),
    ):
        if value < 1:
            raise InvalidArgument(f"{flag} must be 1 or more, got {value}")
    saes = _load_saes(args.sae)
    lmtp_limits = ConnectionLimits(
        max_message_bytes=args.lmtp_max_message_bytes, max_frame_bytes=args.lmtp_max_frame_bytes
    )
    if args.model is None:
        folder = inspect_model_folder(ensure_default_model())
        name = args.served_model_name or DEFAULT_MODEL_NAME
    else:
        folder = inspect_model_folder(args.model)
        name = args.served_model_name or args.model
    concept_set = None
    if args.readouts and (args.concepts is not None or args.model is None):
        from salience.core.probes.concepts import ConceptSet

        path = args.concepts or _default_concepts(folder.path)
        concept_set = ConceptSet.load(path)
        concept_set.check_model(folder.path)
    steering_set = None
    if args.steering is not None:
        from salience.core.probes.concepts import ConceptSet
        from salience.core.probes.steering import Directions

        if not args.steer:
            raise InvalidArgument("--steering and --no-steering contradict each other")
        steering_set = ConceptSet.load(args.steering)
        steering_set.check_model(folder.path)
        Directions(concept_set, steering_set)  # names the sets share, or a zero vector: refused now
    settings = EngineSettings(
        model=folder.path,
        served_model_name=name,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend or ("ray" if args.ray_address else None),
        ray_address=args.ray_address,
        enable_prefix_caching=args.prefix_caching,
        max_logprobs=args.max_logprobs,
        max_images=args.max_images,
        compile=args.compile,
        multiprocess=args.multiprocess,
        engine_args=dict(args.engine_arg),
        concepts=concept_set,
        steering_set=steering_set,
        steering=args.steer,
        spare_concepts=args.spare_concepts,
        steer_vectors=args.steer_vectors,
        saes=saes,
        sae_top=args.sae_top,
        max_residual_rows=args.max_residual_rows,
        residual_memory_mib=args.residual_memory,
    )
    options = ServeOptions(
        host=args.host,
        lmtp_port=args.lmtp_port,
        lmtp_tcp_port=args.lmtp_tcp_port,
        grpc_port=args.grpc_port if args.grpc else None,
        model_aliases=tuple(args.model_alias),
        auth_token=args.auth_token or None,
        admin_token=args.admin_token or None,
        metrics_port=args.metrics_port,
        drain_timeout=args.drain_timeout,
        lmtp_limits=lmtp_limits,
        sessions=SessionLimits(
            ttl=args.session_ttl, max_sessions=args.max_sessions, max_tokens=args.max_session_tokens
        ),
    )
    asyncio.run(serve(settings, options))
    return 0


def _load_saes(specs: list[str]) -> tuple:
    """Each `--sae [NAME=]DIR`, loaded and checked now: a bad folder must not wait for the model."""
    from salience.core.features.sae import load_sae

    saes = []
    for spec in specs:
        name, sep, folder = spec.partition("=")
        saes.append(load_sae(Path(folder), name=name) if sep else load_sae(Path(spec)))
    return tuple(saes)


def _default_concepts(model: Path) -> Path:
    """The built-in concept set for the default model, built once into the cache."""
    from salience.core.models.atomic import build_folder_once
    from salience.core.models.home import salience_home
    from salience.core.serving.concept_builder import build_concept_set, load_spec

    spec_path = Path(__file__).parent.parent / "concept_specs" / "default.yaml"
    spec = load_spec(spec_path)

    def build(folder: Path) -> None:
        built = asyncio.run(build_concept_set(spec, model, source=str(spec_path)))
        built.save(folder / "concepts.safetensors")

    # Named for the spec's content (examples files read in), so an edited spec builds anew.
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:12]
    target = salience_home() / "concepts" / f"{model.name}-{spec['name']}-{digest}"
    return build_folder_once(target, build) / "concepts.safetensors"
