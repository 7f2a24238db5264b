"""The residual rows the server holds at once, across requests: a budget fixed at start.

A request's residual rows wait in the readout hub until its events carry them out (a prefill's,
until the pass ends), so what one request may hold is bounded by its own limit
(`EngineSettings.max_residual_rows`), and what all of them hold by this budget. A request reserves
the most it could hold (positions it may reach x layers) before it reaches vLLM and gives it back
when it ends. Requests that do not fit wait, first come first served, as vLLM queues requests for
KV-cache blocks; one that could never fit is refused before it waits.
"""

from __future__ import annotations

import asyncio
from collections import deque

from salience.errors import InvalidArgument

__all__ = ["RowBudget", "Ticket"]


class Ticket:
    """One request's claim on the budget: granted at once, or queued until rows are given back."""

    def __init__(self, budget: RowBudget, rows: int) -> None:
        self.rows = rows
        self.granted = False
        self._budget = budget
        self._done = False
        self._wake: asyncio.Event | None = None

    async def ready(self) -> bool:
        """Wait until granted: True, or False if the ticket was released (the request cancelled)
        before its turn."""
        if not self.granted and not self._done:
            self._wake = self._wake or asyncio.Event()
            await self._wake.wait()
        return self.granted

    def release(self) -> None:
        """Give the rows back, or leave the queue. Safe to call twice."""
        if self._done:
            return
        self._done = True
        self._budget._returned(self)
        if self._wake is not None:
            self._wake.set()

    def _grant(self) -> None:
        self.granted = True
        if self._wake is not None:
            self._wake.set()


class RowBudget:
    def __init__(self, rows: int, row_bytes: int) -> None:
        self.rows = rows  # the budget: float32 rows of the model's hidden size
        self.row_bytes = row_bytes
        self.held = 0  # rows granted to running requests
        self._queue: deque[Ticket] = deque()

    @property
    def waiting(self) -> int:
        """Requests queued for rows."""
        return len(self._queue)

    def check(self, rows: int, asked: str) -> None:
        if rows > self.rows:
            raise InvalidArgument(
                f"residual asks for {asked}; this server holds at most {self.rows} residual rows at once "
                f"({self.rows * self.row_bytes / 2**20:.0f} MiB, --residual-memory): ask in several requests, "
                "or for fewer layers",
                field="residual",
            )

    def reserve(self, rows: int) -> Ticket:
        """A claim on `rows` (checked against the budget before): granted now if they fit and
        nobody waits, else queued behind those who do."""
        ticket = Ticket(self, rows)
        if rows == 0:  # asks for no residual rows: never waits
            ticket._grant()
        else:
            self._queue.append(ticket)
            self._serve()
        return ticket

    def _returned(self, ticket: Ticket) -> None:
        if ticket.granted:
            self.held -= ticket.rows
        else:
            self._queue.remove(ticket)
        self._serve()  # those behind it may fit now

    def _serve(self) -> None:
        while self._queue and self.held + self._queue[0].rows <= self.rows:
            ticket = self._queue.popleft()
            self.held += ticket.rows
            ticket._grant()
