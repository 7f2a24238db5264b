"""Who a request comes from: the bearer token it offers, mapped to a client with scopes and limits.

Tokens come from three places, all checked the same way:
- `--tokens FILE` (token_file.py): named clients, each with its token's hash, scopes and limits;
- `--auth-token`: one client, `token`, with every scope but `define` and `admin`;
- `--admin-token`: the operator, `admin`, with every scope.

gRPC reads the token from `authorization: Bearer ...` metadata, HTTP from the same header, LMTP
from the header or, for browsers that cannot set headers on a WebSocket, a `token` query
parameter. A server with no token at all is open: every request comes from the anonymous client,
which may do everything but `define` when an operator token exists (the server warns at start).
An offered token is hashed and compared with every client's hash in constant time.

SIGHUP reloads the tokens file (`Tokens.reload`). HTTP and gRPC identify every request anew; an
LMTP connection, identified once as it opens, keeps what it offered in an `Identity`, which
identifies it again when the tokens' generation has moved on, and is told of each reload (`watch`)
so that a connection whose token names no client any more can close.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from salience.core.engine.fair_share import ANONYMOUS
from salience.errors import PermissionDenied

__all__ = [
    "ADMIN_TOKEN_ENV",
    "ANONYMOUS",
    "AUTH_TOKEN_ENV",
    "SCOPES",
    "Client",
    "ClientLimits",
    "Identity",
    "Tokens",
    "TokensWatcher",
    "token_digest",
    "token_from_environment",
]

AUTH_TOKEN_ENV = "SALIENCE_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "SALIENCE_ADMIN_TOKEN"

# What a client may do (docs/security.md#scopes): `admin` holds every other scope.
SCOPES = ("generate", "score", "readouts", "steer", "residual", "features", "sessions", "define", "admin")


def token_from_environment(name: str = AUTH_TOKEN_ENV) -> str | None:
    return os.environ.get(name) or None


def token_digest(token: str) -> bytes:
    """What the tokens file keeps of a token: its SHA-256 (a token is 32 random bytes, so a
    plain hash is as good as a slow one)."""
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True, kw_only=True)
class ClientLimits:
    """Per client, summed over its connections; None: no limit."""

    streams: int | None = None  # running at once, on every frontend
    sessions: int | None = None  # open at once
    tokens_per_minute: int | None = None  # generated tokens, over the last 60 seconds


@dataclass(frozen=True, kw_only=True)
class Client:
    name: str
    scopes: frozenset[str]
    limits: ClientLimits = field(default_factory=ClientLimits)
    weight: float = 1.0  # its share of the engine when clients contend (fair share)
    peer: str | None = None  # an anonymous request's address: fair share counts each peer apart

    @property
    def share(self) -> str:
        """Whom fair share and the token meter count a request against: a named client as one
        however many connections it opens; on an open server, each peer address as one."""
        return self.name if self.peer is None else f"{self.name}@{self.peer}"

    def admission(self) -> dict[str, Any]:
        """ServerStatus.admit's keywords for the client's streams: its name and its limits."""
        return {
            "client": self.name,
            "max_streams": self.limits.streams,
            "tokens_per_minute": self.limits.tokens_per_minute,
        }

    def engine_keywords(self) -> dict[str, Any]:
        """Engine.generate's and prefill's (and a Turn's) keywords naming the request's client."""
        return {"client": self.share, "weight": self.weight}

    def allows(self, scope: str) -> bool:
        return "admin" in self.scopes or scope in self.scopes

    def require(self, scopes: Iterable[str]) -> None:
        """PermissionDenied naming the first scope the client lacks."""
        for scope in scopes:
            if not self.allows(scope):
                raise PermissionDenied(f"client {self.name!r} lacks the scope {scope!r} this request needs")


def _every_scope_but(*left_out: str) -> frozenset[str]:
    return frozenset(SCOPES) - set(left_out)


class TokensWatcher(Protocol):
    def tokens_reloaded(self) -> None:
        """The clients have just been replaced (Tokens.reload)."""


class Tokens:
    """The server's clients by token. `access` and `operator` are --auth-token and --admin-token;
    `clients` the tokens file's, each with the digest of its token (`reload` replaces them).
    `required`: a token is required even with no `access` and no `clients` (a server given a tokens
    file, even an empty one: a reload may fill it, and never opens the server)."""

    def __init__(
        self,
        access: str | None = None,
        operator: str | None = None,
        clients: Sequence[tuple[bytes, Client]] = (),
        *,
        required: bool = False,
    ) -> None:
        shorthands = []
        if access is not None:
            shorthands.append((token_digest(access), Client(name="token", scopes=_every_scope_but("define", "admin"))))
        if operator is not None:
            shorthands.append((token_digest(operator), Client(name="admin", scopes=frozenset({"admin"}))))
        self._shorthands = shorthands
        self._open = not required and access is None and not clients  # anyone may come, as the anonymous client
        # An open server's one client; with an operator token, changing concepts needs it.
        self.anonymous = Client(name=ANONYMOUS, scopes=_every_scope_but(*(("define", "admin") if operator else ())))
        self._known = shorthands + list(clients)
        self._generation = 0
        self._watchers: weakref.WeakSet[TokensWatcher] = weakref.WeakSet()

    @property
    def required(self) -> bool:
        return not self._open

    @property
    def generation(self) -> int:
        """How many reloads there have been: what an Identity compares to know its client may have changed."""
        return self._generation

    def reload(self, clients: Sequence[tuple[bytes, Client]]) -> None:
        """The tokens file's clients, read again (SIGHUP): new requests see them at once, on open
        connections too; the watchers are told. Whether a token is required stays as it was."""
        self._known = self._shorthands + list(clients)
        self._generation += 1
        for watcher in list(self._watchers):
            watcher.tokens_reloaded()

    def watch(self, watcher: TokensWatcher) -> None:
        """Tell `watcher` of every reload, for as long as it lives (held weakly)."""
        self._watchers.add(watcher)

    @property
    def clients(self) -> tuple[Client, ...]:
        return tuple(client for _, client in self._known)

    def identify(
        self, authorization: str | None = None, query_token: str | None = None, peer: str | None = None
    ) -> Client | None:
        """The client an `Authorization` header value or a query token names: a known token's
        client; on an open server, a request offering none is anonymous (from `peer`, its
        address). None: refused."""
        offered = query_token
        if authorization:
            scheme, _, value = authorization.strip().partition(" ")
            offered = value.strip() if scheme.lower() == "bearer" else None
        if offered is None:
            return None if self.required else self.stranger(peer)
        digest = token_digest(offered)
        found = None
        for known, client in self._known:  # every one compared, so the time says nothing of which matched
            if hmac.compare_digest(digest, known) and found is None:
                found = client
        if found is None and not self.required:
            return self.stranger(peer)  # an open server ignores a token it does not know
        return found

    def stranger(self, peer: str | None) -> Client:
        """The anonymous client, as a request from `peer` on an open server."""
        return dataclasses.replace(self.anonymous, peer=peer)


class Identity:
    """A connection's client, kept in step with the tokens: what the connection offered as it
    opened (the `Authorization` header value, the query token, its peer), identified again the
    first time `client` is read after a reload. Between reloads `client` costs no hashing."""

    def __init__(
        self,
        tokens: Tokens,
        authorization: str | None = None,
        query_token: str | None = None,
        peer: str | None = None,
    ) -> None:
        self._tokens = tokens
        self._offered = (authorization, query_token, peer)
        self._generation = tokens.generation
        self._client = tokens.identify(*self._offered)

    @property
    def client(self) -> Client | None:
        """Whom the offered token names now; None: refused (a token no client holds any more)."""
        if self._generation != self._tokens.generation:
            self._generation = self._tokens.generation
            self._client = self._tokens.identify(*self._offered)
        return self._client
