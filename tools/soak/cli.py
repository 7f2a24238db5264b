"""The command line: `python -m tools.soak --help`."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import tools.soak
from tools.soak.options import SoakOptions
from tools.soak.run import run_soak


def parse_args(argv: list[str] | None = None) -> SoakOptions:
    parser = argparse.ArgumentParser(
        description=tools.soak.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = SoakOptions()
    parser.add_argument("model", nargs="?", type=Path, help="model folder to serve (default: the embedded model)")
    parser.add_argument("--url", help="attach to the LMTP WebSocket of a running server, e.g. ws://127.0.0.1:8080/")
    parser.add_argument("--grpc", help="the attached server's gRPC address (default 127.0.0.1:50051)")
    parser.add_argument("--pid", type=int, help="the attached server's pid, to sample its RSS and open fds")
    parser.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=[],
        help="another `salience serve` flag (repeatable)",
    )
    parser.add_argument("--auth-token", default=os.environ.get("SALIENCE_AUTH_TOKEN"))
    parser.add_argument(
        "--secure",
        action="store_true",
        help="start the server behind TLS (a certificate made for the run) with a tokens file (--tokens)",
    )
    parser.add_argument("--seconds", type=float, default=defaults.seconds)
    parser.add_argument("--connections", type=int, default=defaults.connections)
    parser.add_argument("--streams", type=int, default=defaults.streams, help="concurrent streams per connection")
    parser.add_argument("--sessions", type=int, default=defaults.sessions, help="gRPC session workers")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="max_tokens of a valid stream")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        help="--lmtp-max-message-bytes of a started server (1 MiB), or what the attached one was given (16 MiB)",
    )
    parser.add_argument(
        "--max-frame-bytes",
        type=int,
        help="--lmtp-max-frame-bytes of a started server (twice the message limit), or of the attached one",
    )
    parser.add_argument("--stream-timeout", type=float, default=defaults.stream_timeout)
    parser.add_argument("--start-timeout", type=float, default=defaults.start_timeout)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--skip", action="append", default=[], help="leave out an LMTP job kind (repeatable)")
    parser.add_argument("--log", type=Path, help="a started server's log file (default: a temporary file)")
    args = parser.parse_args(argv)
    if args.url is None and (args.grpc or args.pid):
        parser.error("--grpc and --pid go with --url")
    if args.secure and (args.url or args.auth_token):
        parser.error("--secure starts its own server and token: not with --url or --auth-token")
    # Every flag's dest is a SoakOptions field.
    return SoakOptions(**vars(args) | {"server_args": tuple(args.server_args), "skip": tuple(args.skip)})


def main(argv: list[str] | None = None) -> int:
    report = asyncio.run(run_soak(parse_args(argv)))
    print(report.render())
    return 1 if report.failures() else 0
