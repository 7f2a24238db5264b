"""The `salience` command line: each subcommand's module adds its parser and runs it (serve,
concepts, convert and tokens here, capture and features in salience.capture.commands); `main`
parses and dispatches."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from salience.auth import AUTH_TOKEN_ENV, token_from_environment
from salience.capture.commands import add_capture_parsers, run_capture, run_features
from salience.cli.concepts import add_concepts_parser, run_concepts
from salience.cli.convert import add_convert_parser, run_convert
from salience.cli.patch import add_patch_parser, run_patch
from salience.cli.serve import run_serve
from salience.cli.serve_flags import add_serve_parser
from salience.cli.tokens import add_tokens_parser, run_tokens
from salience.core.models.home import configure_environment
from salience.errors import SalienceError
from salience.tls import ClientTls

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="salience", description="Inference server over vLLM with concept readouts.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(commands)
    add_concepts_parser(commands)
    add_convert_parser(commands)
    add_capture_parsers(commands)
    add_tokens_parser(commands)
    repl = commands.add_parser("repl", help="interactive prompt against a running server")
    repl.add_argument("url", nargs="?", default="ws://127.0.0.1:8080/", help="LMTP WebSocket URL (wss:// for TLS)")
    add_client_flags(repl)
    add_patch_parser(commands, add_client_flags)
    return parser


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """How a client reaches a server with tokens and TLS (the REPL's, and tools' that connect)."""
    parser.add_argument(
        "--token", default=token_from_environment(), help=f"the bearer token (default: ${AUTH_TOKEN_ENV})"
    )
    parser.add_argument(
        "--ca", type=Path, metavar="FILE", help="trust this CA (PEM) for wss:// (default: the system's)"
    )
    parser.add_argument("--cert", type=Path, metavar="FILE", help="a client certificate (PEM), for mutual TLS")
    parser.add_argument("--key", type=Path, metavar="FILE", help="the client certificate's private key (PEM)")


def main(argv: list[str] | None = None) -> int:
    """The `salience` command. As the process's own command line (`argv` None) it returns only
    once every process it started has ended (core/engine/start/children.py); called with `argv`, as tests do, it
    leaves the calling process's other children alone."""
    if argv is not None:
        return _run(argv)
    # Until the server's loop takes SIGTERM over (and after it gives it back), SIGTERM ends the
    # command through the `finally`, which waits for the processes the command started.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _run(sys.argv[1:])
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the wait short
        _end_children()


def _end_children() -> None:
    try:
        from salience.core.engine.start.children import end_children
    except ModuleNotFoundError:  # the client-only install (no psutil) starts no process
        return
    end_children()


def parse(argv: list[str]) -> argparse.Namespace:
    """The `salience` command line's arguments (a tool that runs a command in its own process)."""
    return _parser().parse_args(argv)


def _run(argv: list[str]) -> int:
    args = parse(argv)
    configure_environment()
    from salience.logs import setup_logging

    setup_logging(getattr(args, "log_level", "info"))
    if args.command in ("repl", "patch"):
        try:
            tls = ClientTls(ca=args.ca, cert=args.cert, key=args.key)
            if args.command == "patch":
                return asyncio.run(run_patch(args, tls))
        except SalienceError as exc:
            print(f"salience: error: {exc}", file=sys.stderr)
            return 2
        from salience.repl.console import run_repl

        return run_repl(args.url, tls=tls, token=args.token)
    try:
        if args.command == "capture":
            return asyncio.run(run_capture(args))
        if args.command == "features":
            return run_features(args)
        if args.command == "tokens":
            return run_tokens(args)
        if args.command == "convert":
            return run_convert(args)
        return run_concepts(args) if args.command == "concepts" else run_serve(args)
    except SalienceError as exc:
        print(f"salience: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the engine failed to start: one line, details with --log-level debug
        print(f"salience: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("SALIENCE_TRACEBACK"):
            raise
        return 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
