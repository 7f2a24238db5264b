"""The sessions a store holds, and the rules for holding them: whose each is, how long it may sit
idle, and how many sessions and stored tokens fit.

A session is its owner's, the client that opened it (`Client.share`: a named client, or on an
open server a peer address); every call names its client, and another's session is, to it, one
that does not exist: the same NotFound as an unknown id, so an id reveals nothing.

Idle sessions expire after a TTL; every call on a session refreshes it. Past the limits on
session count or stored tokens the least recently used idle session is evicted; a session
with a running turn is never evicted.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from salience.core.serving.observers import OBSERVERS
from salience.core.serving.turns import TurnRun
from salience.errors import NotFound, ResourceExhausted

__all__ = ["Held", "SessionLimits", "SessionPool"]


@dataclass(frozen=True, kw_only=True)
class SessionLimits:
    ttl: float = 1800.0  # seconds a session may sit idle
    max_sessions: int = 4096
    max_tokens: int = 50_000_000  # stored across all sessions (4 bytes each)


class Held(Protocol):
    """A session as the pool sees it (sessions.py holds the rest): declared here, not imported,
    because sessions.py imports this module."""

    last_used: float

    @property
    def id(self) -> str: ...

    @property
    def owner(self) -> str: ...

    @property
    def tokens(self) -> array: ...

    @property
    def run(self) -> TurnRun | None: ...  # a running turn: the session is not idle


S = TypeVar("S", bound=Held)


class SessionPool(Generic[S]):
    """Every session of one store, least recently used first. Not thread-safe: use from the event loop."""

    def __init__(self, limits: SessionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._sessions: dict[str, S] = {}  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: S) -> bool:
        return session.id in self._sessions

    def stored_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    def add(self, session: S) -> None:
        """Hold a new session (its room made first: `make_room`)."""
        self._sessions[session.id] = session
        self.touch(session)
        OBSERVERS.sessions_created()

    def get(self, session_id: str, owner: str) -> S:
        """`owner`'s session, refreshed: another's is NotFound as an unknown one is, word for word."""
        self.sweep()
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"no session {session_id!r}: it was closed, evicted after idling, or never existed")
        self.touch(session)
        return session

    def remove(self, session_id: str, owner: str) -> S | None:
        """Forget `owner`'s session and return it; None for an unknown id or another's, which stays."""
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            return None
        del self._sessions[session_id]
        return session

    def touch(self, session: S) -> None:
        session.last_used = self._clock()
        self._sessions[session.id] = self._sessions.pop(session.id)  # move to most recent

    def check_quota(self, owner: str, max_owned: int | None) -> None:
        """A client's limit on open sessions; the retry-after is when its longest idle one expires."""
        if max_owned is None:
            return
        self.sweep()
        owned = [s for s in self._sessions.values() if s.owner == owner]
        if len(owned) >= max_owned:
            wait = max(self.limits.ttl - (self._clock() - min(s.last_used for s in owned)), 0.0)
            raise ResourceExhausted(
                f"client {owner!r} holds {len(owned)} sessions, its limit: close one, or retry when its "
                f"longest idle one expires (in {wait:.0f} s)",
                retry_after=wait,
            )

    def make_room(self, *, sessions: int, tokens: int, keep: S | None) -> None:
        """Evict least recently used idle sessions until the new sessions and tokens fit."""
        self.sweep()
        limits = self.limits
        floor = tokens + (len(keep.tokens) if keep is not None else 0)  # what stays whatever is evicted
        if floor > limits.max_tokens:
            raise ResourceExhausted(f"{floor} tokens exceed the server's limit of {limits.max_tokens} stored tokens")
        stored = self.stored_tokens()
        idle = [s for s in self._sessions.values() if s.run is None and s is not keep]
        while len(self._sessions) + sessions > limits.max_sessions or stored + tokens > limits.max_tokens:
            if not idle:
                raise ResourceExhausted(
                    f"session limits reached: {len(self._sessions)} of {limits.max_sessions} sessions, "
                    f"{stored} of {limits.max_tokens} stored tokens, and no other session is idle to evict"
                )
            victim = idle.pop(0)
            stored -= len(victim.tokens)
            del self._sessions[victim.id]
            OBSERVERS.sessions_evicted("lru", 1)

    def sweep(self) -> int:
        """Evict sessions idle longer than the TTL; return how many went."""
        deadline = self._clock() - self.limits.ttl
        expired = [s.id for s in self._sessions.values() if s.run is None and s.last_used < deadline]
        for session_id in expired:
            del self._sessions[session_id]
        if expired:
            OBSERVERS.sessions_evicted("ttl", len(expired))
        return len(expired)

    async def sweep_forever(self) -> None:
        """Evict expired sessions even when no calls come in (their memory is not free)."""
        while True:
            await asyncio.sleep(min(60.0, max(self.limits.ttl / 4, 0.05)))
            self.sweep()
