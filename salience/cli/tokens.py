"""`salience tokens`: add a client to a tokens file (its new token printed once), or list them."""

from __future__ import annotations

import argparse
from pathlib import Path

from salience.auth import SCOPES, ClientLimits

__all__ = ["add_tokens_parser", "run_tokens"]


def add_tokens_parser(commands: argparse._SubParsersAction) -> None:
    tokens = commands.add_parser("tokens", help="manage the clients of a tokens file (--tokens)").add_subparsers(
        dest="tokens_command", required=True
    )
    add = tokens.add_parser("add", help="add a client and print its new token once (the file keeps only its hash)")
    add.add_argument("name", help="the client's name, as logs and /metrics show it (A-Z a-z 0-9 . _ -)")
    add.add_argument("--file", type=Path, required=True, help="the tokens file (made, owner-only, if missing)")
    add.add_argument(
        "--scopes", required=True, help=f"comma-separated, among {', '.join(SCOPES)} (admin holds every scope)"
    )
    add.add_argument("--max-streams", type=int, metavar="N", help="streams running at once (default: no limit)")
    add.add_argument("--max-sessions", type=int, metavar="N", help="sessions open at once (default: no limit)")
    add.add_argument(
        "--tokens-per-minute", type=int, metavar="N", help="generated tokens over any minute (default: no limit)"
    )
    add.add_argument("--weight", type=float, default=1.0, help="its share under contention (default: %(default)s)")
    listing = tokens.add_parser("list", help="the file's clients, their scopes and limits")
    listing.add_argument("--file", type=Path, required=True)


def run_tokens(args: argparse.Namespace) -> int:
    from salience.token_file import add_client, load_token_file

    if args.tokens_command == "add":
        limits = ClientLimits(
            streams=args.max_streams, sessions=args.max_sessions, tokens_per_minute=args.tokens_per_minute
        )
        scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
        token = add_client(args.file, args.name, scopes, limits, args.weight)
        print(token)
        return 0
    for _, client in load_token_file(args.file):
        limits = ", ".join(f"{key} {value}" for key, value in vars(client.limits).items() if value is not None)
        print(f"{client.name}: {', '.join(sorted(client.scopes))}; {limits or 'no limits'}; weight {client.weight:g}")
    return 0
