"""What the serving layer reports as it runs, to whoever subscribes (salience.metrics does).

Core imports no metrics library and nothing that imports core: it reports through this
interface, and the reporting side subscribes to it, so the dependency runs one way.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["OBSERVERS", "ResidualCounts", "ServingObserver", "SessionCounts"]


class SessionCounts(Protocol):
    """A session store as observers see it: how much it holds right now."""

    def __len__(self) -> int: ...

    def stored_tokens(self) -> int: ...


class ResidualCounts(Protocol):
    """The residual-row budget (engine/row_budget.py) as observers see it."""

    rows: int  # the budget
    held: int  # rows granted to running requests

    @property
    def waiting(self) -> int: ...


class ServingObserver:
    """Every event the serving layer reports; each method does nothing unless overridden."""

    def stream_admitted(self, frontend: str, kind: str, client: str | None) -> None:
        """A stream (`kind`: generate, score, session_generate) of `client` (None: the server's
        own) was admitted to run."""

    def stream_ended(self, frontend: str, kind: str, finish_reason: str) -> None:
        """An admitted stream ended: `stop`, `length`, `cancelled` or `error`."""

    def store_opened(self, store: SessionCounts) -> None:
        """A session store exists; it may be read (not changed) for as long as it lives."""

    def budget_opened(self, budget: ResidualCounts) -> None:
        """An engine's residual-row budget serves; it may be read (not changed) while it lives."""

    def sessions_created(self) -> None:
        """A session was opened or forked."""

    def sessions_evicted(self, reason: str, count: int) -> None:
        """`count` sessions were evicted: `ttl` (idle too long) or `lru` (limits reached)."""


class _Observers(ServingObserver):
    """Passes each event on to every subscriber, in the order they subscribed."""

    def __init__(self) -> None:
        self._subscribers: list[ServingObserver] = []

    def subscribe(self, observer: ServingObserver) -> None:
        self._subscribers.append(observer)

    def stream_admitted(self, frontend: str, kind: str, client: str | None) -> None:
        for observer in self._subscribers:
            observer.stream_admitted(frontend, kind, client)

    def stream_ended(self, frontend: str, kind: str, finish_reason: str) -> None:
        for observer in self._subscribers:
            observer.stream_ended(frontend, kind, finish_reason)

    def store_opened(self, store: SessionCounts) -> None:
        for observer in self._subscribers:
            observer.store_opened(store)

    def budget_opened(self, budget: ResidualCounts) -> None:
        for observer in self._subscribers:
            observer.budget_opened(budget)

    def sessions_created(self) -> None:
        for observer in self._subscribers:
            observer.sessions_created()

    def sessions_evicted(self, reason: str, count: int) -> None:
        for observer in self._subscribers:
            observer.sessions_evicted(reason, count)


OBSERVERS = _Observers()  # the process's one fan-out point: the serving layer reports here
