"""What a run is asked to do, and how the tool speaks while it runs."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
SERVER_DEFAULT_MESSAGE_BYTES = 16 * MIB  # a server without --lmtp-max-message-bytes


@dataclass(kw_only=True)
class SoakOptions:
    model: Path | None = None  # None: the embedded default model
    url: str | None = None  # attach to this LMTP WebSocket instead of starting a server
    grpc: str | None = None  # host:port of the attached server's gRPC service
    pid: int | None = None  # the attached server's process, for RSS and fds
    server_args: tuple[str, ...] = ()  # more `salience serve` flags for a started server
    auth_token: str | None = None
    # A started server behind TLS (a CA and certificate made for the run) with a tokens file whose
    # one client, holding every scope, the run speaks as.
    secure: bool = False
    seconds: float = 60.0
    connections: int = 4
    streams: int = 4  # concurrent workers per connection
    sessions: int = 2  # gRPC session workers
    tokens: int = 16  # max_tokens of a valid stream; cancels and carriers run 4x as long
    max_message_bytes: int | None = None  # started server: 1 MiB; attached: what it was given
    max_frame_bytes: int | None = None  # started server: twice the message limit; attached: unknown
    stream_timeout: float = 120.0
    start_timeout: float = 900.0
    idle_streams: int = 5
    sample_every: float = 5.0
    progress_every: float = 10.0
    seed: int = 0
    skip: tuple[str, ...] = ()  # LMTP job kinds left out (e.g. "oversized")
    log: Path | None = None  # a started server's log (default: a temporary file)


def say(text: str) -> None:
    print(f"soak: {text}", file=sys.stderr, flush=True)
