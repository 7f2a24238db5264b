"""The residual budget's admission on its own: first come first served, cancellation at any moment
gives every row back. The engine's use of it is tested in test_residuals.py."""

from __future__ import annotations

import asyncio

import pytest

from salience.core.engine.row_budget import RowBudget
from salience.errors import InvalidArgument


async def test_requests_are_granted_in_order_as_rows_come_back() -> None:
    budget = RowBudget(10, 4)
    first, big, small = budget.reserve(6), budget.reserve(8), budget.reserve(1)
    assert first.granted and not big.granted and not small.granted  # small fits, but waits behind big
    assert (budget.held, budget.waiting) == (6, 2)
    waiters = [asyncio.create_task(ticket.ready()) for ticket in (big, small)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    first.release()
    assert await asyncio.gather(*waiters) == [True, True]
    assert (budget.held, budget.waiting) == (9, 0)
    big.release()
    small.release()
    small.release()  # twice: harmless
    assert budget.held == 0


async def test_leaving_the_queue_lets_those_behind_in() -> None:
    budget = RowBudget(10, 4)
    running, big, small = budget.reserve(5), budget.reserve(8), budget.reserve(5)
    waiter = asyncio.create_task(big.ready())
    await asyncio.sleep(0)
    big.release()  # cancelled while it waits
    assert await waiter is False
    assert small.granted and (budget.held, budget.waiting) == (10, 0)
    running.release()
    small.release()
    assert budget.held == 0


async def test_a_waiting_task_cancelled_takes_nothing() -> None:
    budget = RowBudget(10, 4)
    running, queued = budget.reserve(10), budget.reserve(3)

    async def use(ticket):
        try:
            await ticket.ready()
        finally:
            ticket.release()

    task = asyncio.create_task(use(queued))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    running.release()
    assert (budget.held, budget.waiting) == (0, 0)


async def test_no_rows_never_wait() -> None:
    budget = RowBudget(10, 4)
    budget.reserve(6)
    budget.reserve(6)  # queued
    assert budget.reserve(0).granted and budget.waiting == 1


def test_a_request_beyond_the_whole_budget_is_refused() -> None:
    budget = RowBudget(2048, 4 * 1536)
    budget.check(2048, "2048 positions x 1 layers")
    with pytest.raises(InvalidArgument, match=r"at most 2048 residual rows at once \(12 MiB, --residual-memory\)"):
        budget.check(2049, "683 positions x 3 layers")
