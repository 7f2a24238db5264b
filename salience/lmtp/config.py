"""What a server's LMTP connections are held to, and the transport rules a start checks: kept
apart from the connection logic (session.py) so that `salience serve` checks its flags before it
imports the engine, and a bad flag is refused at once."""

from __future__ import annotations

from dataclasses import dataclass, field

from salience.auth import Tokens
from salience.errors import InvalidArgument
from salience.lmtp.codec import MAX_FRAME_BYTES, MAX_MESSAGE_BYTES

__all__ = ["ConnectionLimits", "LmtpConfig", "check_tcp_auth"]


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    max_pending: int = 65536  # payloads waiting for a client that does not read
    send_timeout: float = 30.0  # seconds one frame may take to go out
    # A message over max_message_bytes gets an error (its stream's, if it names one), unparsed;
    # one over max_frame_bytes closes the connection: the transports read no further.
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_frame_bytes: int = MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        if not 0 < self.max_message_bytes <= self.max_frame_bytes:
            raise InvalidArgument(
                f"--lmtp-max-message-bytes ({self.max_message_bytes}) must be positive and at most "
                f"--lmtp-max-frame-bytes ({self.max_frame_bytes})"
            )


@dataclass(frozen=True, kw_only=True)
class LmtpConfig:
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    tokens: Tokens = field(default_factory=Tokens)  # who may connect, and what each client may do


def check_tcp_auth(tokens_required: bool, tcp_port: int | None) -> None:
    """LMTP over TCP has no place for a token (no handshake carries one): refuse a server that
    requires one."""
    if tokens_required and tcp_port is not None:
        raise InvalidArgument(
            "--lmtp-tcp-port cannot carry a token: serve it without --auth-token and --tokens, or use the WebSocket"
        )
