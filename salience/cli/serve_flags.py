"""`salience serve`'s flags: one argument group per topic, in the order `--help` and
docs/serve.md show them. The groups of how vLLM holds and runs the model are engine_flags.py's."""

from __future__ import annotations

import argparse
from pathlib import Path

from salience.auth import ADMIN_TOKEN_ENV, AUTH_TOKEN_ENV, token_from_environment
from salience.cli.engine_flags import add_engine_groups

__all__ = ["add_serve_parser"]


# The help strings are the flags' one description: `salience serve --help` prints them and
# tools/gen_serve_docs.py renders them into docs/serve.md, where a trailing "(default: ...)" fills
# the default column, docs/NAME.md becomes a link, and --flags and $VARIABLES become code.


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="load a model and serve it",
        description="Load one model into vLLM and serve it to many clients: LMTP over a WebSocket "
        "(docs/lmtp.md) and the OpenAI API over HTTP (docs/openai.md) on one port, beside GET /health, "
        "GET /metrics and the browser page (docs/ui.md), and the salience.v1 gRPC service (docs/grpc.md), "
        "with concept readouts, steering and SAE features.",
    )
    for add_group in (
        _model,
        _network,
        _auth,
        _tls,
        _limits,
        _sessions,
        _fair_share,
        add_engine_groups,
        _logging,
    ):
        add_group(serve)


def _model(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("model")
    group.add_argument(
        "--model",
        metavar="DIR",
        help="any local Hugging Face model folder vLLM supports (default: the embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument("--served-model-name", metavar="NAME", help="the name clients use (default: --model as given)")
    group.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another model name requests may use (repeatable)",
    )
    group.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template to render chat messages with, in place of the model's own; a model without "
        "one takes messages only with it (docs/lmtp.md#chat-messages) (default: the model's own, from its folder)",
    )
    group.add_argument(
        "--tool-call-parser",
        metavar="NAME",
        help="vLLM's parser for the tool calls a model writes (hermes, mistral, llama3_json, ...), which "
        'tool_choice "auto" needs on /v1/chat/completions (docs/openai.md#tools) (default: the one the chat '
        "template names: hermes for one that writes Hermes' tool_call tags)",
    )


def _network(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("network", "The ports, and how the server stops.")
    group.add_argument("--host", default="127.0.0.1", help="the address every port listens on (default: %(default)s)")
    group.add_argument(
        "--lmtp-port",
        type=int,
        default=8080,
        metavar="PORT",
        help="the LMTP WebSocket at /, the OpenAI API at /v1/ (docs/openai.md), GET /health, GET /metrics "
        "(Prometheus; behind the token when one is set) and the browser page at /ui/ (default: %(default)s)",
    )
    group.add_argument(
        "--lmtp-tcp-port",
        type=int,
        metavar="PORT",
        help="also serve LMTP over plain TCP, one message per line (default: off)",
    )
    group.add_argument(
        "--grpc-port",
        type=int,
        default=50051,
        metavar="PORT",
        help="the salience.v1 gRPC service, health and reflection (default: %(default)s)",
    )
    group.add_argument("--no-grpc", dest="grpc", action="store_false", help="serve no gRPC")
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="also serve GET /metrics on a port of its own, without auth, for a private network "
        "(docs/metrics.md) (default: off)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds in-flight streams may run after SIGTERM before they are cancelled; new ones are refused "
        "at once (docs/metrics.md#draining-sigterm) (default: %(default)g)",
    )


def _auth(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("auth", "Bearer tokens, scopes and limits (docs/security.md#tokens-and-scopes).")
    group.add_argument(
        "--auth-token",
        default=token_from_environment(),
        metavar="TOKEN",
        help=f"the token every gRPC call and WebSocket must present (default: ${AUTH_TOKEN_ENV}; unset: open)",
    )
    group.add_argument(
        "--admin-token",
        default=token_from_environment(ADMIN_TOKEN_ENV),
        metavar="TOKEN",
        help="the operator's token, holding every scope: alone it may define, delete and save live concepts "
        f"(docs/live-concepts.md#who-may-change-them) (default: ${ADMIN_TOKEN_ENV}; unset: anyone may on an "
        "open server, which warns, and nobody on one with --auth-token)",
    )
    group.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="clients, each with its token's hash, scopes and limits (docs/security.md#tokens-and-scopes; "
        "`salience tokens add` writes it); SIGHUP reloads it",
    )


def _tls(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "TLS", "Every port behind TLS: wss:// and https://, LMTP over TCP, metrics and gRPC (docs/security.md#tls)."
    )
    group.add_argument("--tls-cert", type=Path, metavar="FILE", help="the server's certificate chain (PEM)")
    group.add_argument(
        "--tls-key",
        type=Path,
        metavar="FILE",
        help="its private key (PEM); an encrypted one needs --tls-key-password-file",
    )
    group.add_argument(
        "--tls-key-password-file",
        type=Path,
        metavar="FILE",
        help="the encrypted key's password: this file's first line; SIGHUP reads it again with the key",
    )
    group.add_argument(
        "--tls-client-ca",
        type=Path,
        metavar="FILE",
        help="require clients' certificates, signed by these CAs (PEM): mutual TLS on every port",
    )


def _limits(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("limits", "What one request, or all of them at once, may ask for.")
    group.add_argument(
        "--lmtp-max-message-bytes",
        type=int,
        default=16 * 2**20,
        metavar="BYTES",
        help="largest LMTP message parsed (about 12 MiB of base64 images); a larger one gets an error for its "
        "stream, and the connection carries on (docs/lmtp.md#message-size) (default: 16 MiB)",
    )
    group.add_argument(
        "--lmtp-max-frame-bytes",
        type=int,
        default=256 * 2**20,
        metavar="BYTES",
        help="largest LMTP message read at all: a larger one closes its connection (WebSocket close code 1009) "
        "(default: 256 MiB)",
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        metavar="N",
        help="largest top-k a request may ask for (default: %(default)s)",
    )
    group.add_argument(
        "--max-images",
        type=int,
        default=16,
        metavar="N",
        help="vision-language models: images a session may hold (default: %(default)s)",
    )
    group.add_argument(
        "--max-residual-rows",
        type=int,
        default=16384,
        metavar="N",
        help="residual rows (positions x layers) one request may ask for (docs/residuals.md#limits) "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--residual-memory",
        type=int,
        default=512,
        metavar="MIB",
        help="residual rows all requests may hold at once, in MiB of float32; requests beyond it wait their turn "
        "(default: %(default)s)",
    )


def _sessions(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "sessions", "Past --max-sessions or --max-session-tokens the least recently used idle session is evicted."
    )
    group.add_argument(
        "--session-ttl",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="seconds an idle session is kept (default: %(default)g)",
    )
    group.add_argument(
        "--max-sessions", type=int, default=4096, metavar="N", help="sessions kept at once (default: %(default)s)"
    )
    group.add_argument(
        "--max-session-tokens",
        type=int,
        default=50_000_000,
        metavar="N",
        help="tokens stored across all sessions (default: %(default)s)",
    )


def _fair_share(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group(
        "fair share",
        "On a contended engine each active client gets an equal share of the tokens it generates, weighted, "
        "however many streams it opens (docs/security.md#fair-share).",
    )
    group.add_argument(
        "--no-fair-share",
        dest="fair_share",
        action="store_false",
        help="let every request into vLLM as it comes, first come first served, with no per-client lines",
    )
    group.add_argument(
        "--max-running",
        type=int,
        metavar="N",
        help="requests running at once, per engine replica, before fair share holds any back: past N only a client "
        "below its share of N starts at once (up to vLLM's max_num_seqs), the others wait, the least served "
        "client's first (default: 3/4 of max_num_seqs: 96 on CPU)",
    )


def _logging(serve: argparse.ArgumentParser) -> None:
    serve.add_argument_group("logging").add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logs are logfmt lines on stderr, vLLM's processes included; libraries speak from WARNING, "
        "less the warnings about settings Salience chooses on purpose (eager mode, whole-prompt prefill); "
        "debug shows everything (default: %(default)s)",
    )
