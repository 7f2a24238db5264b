"""The optional shared bearer token every frontend checks.

One token for the whole server (the seed's "shared bearer token"): gRPC reads it from
`authorization: Bearer ...` metadata, LMTP from the same header or, for browsers that
cannot set headers on a WebSocket, a `token` query parameter.
"""

from __future__ import annotations

import hmac
import os

__all__ = ["AUTH_TOKEN_ENV", "bearer_matches", "token_from_environment"]

AUTH_TOKEN_ENV = "SALIENCE_AUTH_TOKEN"


def token_from_environment() -> str | None:
    return os.environ.get(AUTH_TOKEN_ENV) or None


def bearer_matches(expected: str, authorization: str | None = None, query_token: str | None = None) -> bool:
    """Whether an `Authorization` header value or a query token carries `expected`, in constant time."""
    offered = query_token
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        offered = value.strip() if scheme.lower() == "bearer" else None
    if offered is None:
        return False
    return hmac.compare_digest(offered.encode(), expected.encode())
