"""The optional bearer tokens every frontend checks: the shared access token, and the operator's.

One access token for the whole server (the seed's "shared bearer token"): gRPC reads it from
`authorization: Bearer ...` metadata, LMTP from the same header or, for browsers that cannot set
headers on a WebSocket, a `token` query parameter. The operator token (`--admin-token`) is
offered the same way; it grants access too, and alone it may change what every client sees
(define, delete and save live concepts).
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

__all__ = ["ADMIN_TOKEN_ENV", "AUTH_TOKEN_ENV", "Tokens", "bearer_matches", "token_from_environment"]

AUTH_TOKEN_ENV = "SALIENCE_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "SALIENCE_ADMIN_TOKEN"


def token_from_environment(name: str = AUTH_TOKEN_ENV) -> str | None:
    return os.environ.get(name) or None


def bearer_matches(expected: str, authorization: str | None = None, query_token: str | None = None) -> bool:
    """Whether an `Authorization` header value or a query token carries `expected`, in constant time."""
    offered = query_token
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        offered = value.strip() if scheme.lower() == "bearer" else None
    if offered is None:
        return False
    return hmac.compare_digest(offered.encode(), expected.encode())


@dataclass(frozen=True)
class Tokens:
    access: str | None = None  # every client's; None: the server is open
    operator: str | None = None  # the operator's; None: operator acts need... see `is_operator`

    @property
    def required(self) -> bool:
        return self.access is not None

    def admits(self, authorization: str | None = None, query_token: str | None = None) -> bool:
        if self.access is None:
            return True
        return any(
            token is not None and bearer_matches(token, authorization, query_token)
            for token in (self.access, self.operator)
        )

    def is_operator(self, authorization: str | None = None, query_token: str | None = None) -> bool:
        """With an operator token: whoever offers it. Without one: anyone on an open server (it
        warns at start), nobody on a server with an access token."""
        if self.operator is not None:
            return bearer_matches(self.operator, authorization, query_token)
        return self.access is None
