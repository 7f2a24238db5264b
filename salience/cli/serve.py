"""`salience serve`: loading what its flags name, and checking it, before the engine starts
(the flags themselves: serve_flags.py and engine_flags.py)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.core.engine.settings import EngineSettings
    from salience.server import ServeOptions

__all__ = ["configure", "run_serve"]


def run_serve(args: argparse.Namespace) -> int:
    settings, options = configure(args)  # first: a bad flag is refused before the server's imports
    from salience.server import serve

    asyncio.run(serve(settings, options))
    return 0


def configure(args: argparse.Namespace) -> tuple[EngineSettings, ServeOptions]:
    """What `salience serve ARGS` runs: its engine's settings and its frontends' options, every
    flag checked (a benchmark runs the same server in its own process: tools/bench_stages.py)."""
    from salience.core.engine.chat import load_chat_template
    from salience.core.engine.start.fork_server import start_early
    from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
    from salience.core.models.folders import inspect_model_folder
    from salience.lmtp.config import ConnectionLimits, check_tcp_auth
    from salience.token_file import load_token_file

    # First what needs no engine code: a bad flag or folder is refused at once, not after the
    # seconds it takes to import vLLM, let alone load the model.
    _check_counts(args)
    lmtp_limits = ConnectionLimits(
        max_message_bytes=args.lmtp_max_message_bytes, max_frame_bytes=args.lmtp_max_frame_bytes
    )
    if args.tokens is not None:
        load_token_file(args.tokens)  # checked now; the server loads it again as it starts
    check_tcp_auth(bool(args.auth_token) or args.tokens is not None, args.lmtp_tcp_port)
    tls = _server_tls(args)
    saes = _load_saes(args.sae)
    chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
    if args.model is not None:
        folder = inspect_model_folder(args.model)
    backend = args.distributed_executor_backend or ("ray" if args.ray_address else None)
    # vLLM's engine core then forks from a server that imports vLLM while this process does.
    fork_server = args.fork_server and backend != "ray" and start_early()

    from salience.core.engine.settings import EngineSettings
    from salience.core.engine.tool_parsers import check_parser
    from salience.core.serving.sessions import SessionLimits
    from salience.server import ServeOptions

    if args.model is None:
        folder = inspect_model_folder(ensure_default_model())
        name = args.served_model_name or DEFAULT_MODEL_NAME
    else:
        name = args.served_model_name or args.model
    concept_set, steering_set = _concept_sets(args, folder.path)
    settings = EngineSettings(
        model=folder.path,
        served_model_name=name,
        chat_template=chat_template,
        tool_call_parser=check_parser(args.tool_call_parser) if args.tool_call_parser is not None else None,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=backend,
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
        patch_points=args.patch_points,
        max_residual_rows=args.max_residual_rows,
        residual_memory_mib=args.residual_memory,
        fair_share=args.fair_share,
        max_running=args.max_running,
        fork_server=fork_server,
    )
    options = ServeOptions(
        host=args.host,
        lmtp_port=args.lmtp_port,
        lmtp_tcp_port=args.lmtp_tcp_port,
        grpc_port=args.grpc_port if args.grpc else None,
        model_aliases=tuple(args.model_alias),
        auth_token=args.auth_token or None,
        admin_token=args.admin_token or None,
        tokens_file=args.tokens,
        metrics_port=args.metrics_port,
        drain_timeout=args.drain_timeout,
        lmtp_limits=lmtp_limits,
        tls=tls,
        sessions=SessionLimits(
            ttl=args.session_ttl, max_sessions=args.max_sessions, max_tokens=args.max_session_tokens
        ),
    )
    return settings, options


def _server_tls(args: argparse.Namespace):
    """The TLS files, read and checked now (a mismatched key, an encrypted one without its
    password, or an expired certificate stops the start with one line), or None without --tls-cert."""
    from salience.tls import ServerTls, TlsFiles

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        if args.tls_key_password_file is not None:
            raise InvalidArgument("--tls-key-password-file needs --tls-cert and --tls-key: it is the key's password")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise InvalidArgument("--tls-cert and --tls-key go together: the certificate and its private key")
    files = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca, key_password=args.tls_key_password_file)
    return ServerTls(files)


def _check_counts(args: argparse.Namespace) -> None:
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


def _concept_sets(args: argparse.Namespace, model: Path) -> tuple:
    """The concept set read out (None without readouts) and the --steering set (None without one), checked
    against the model."""
    from salience.core.probes.concepts import ConceptSet

    concept_set = None
    if args.readouts:
        from salience.core.serving.default_concepts import default_concepts

        concept_set = ConceptSet.load(args.concepts or default_concepts(model))
        concept_set.check_model(model)
    steering_set = None
    if args.steering is not None:
        from salience.core.probes.steering import Directions

        if not args.steer:
            raise InvalidArgument("--steering and --no-steering contradict each other")
        steering_set = ConceptSet.load(args.steering)
        steering_set.check_model(model)
        Directions(concept_set, steering_set)  # names the sets share, or a zero vector: refused now
    return concept_set, steering_set


def _load_saes(specs: list[str]) -> tuple:
    """Each `--sae [NAME=]DIR`, loaded and checked now: a bad folder must not wait for the model."""
    from salience.core.features.sae import load_sae

    saes = []
    for spec in specs:
        name, sep, folder = spec.partition("=")
        saes.append(load_sae(Path(folder), name=name) if sep else load_sae(Path(spec)))
    return tuple(saes)
