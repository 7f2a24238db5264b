"""Servers measured in turns of a fraction of a second, each running while the others' engines are
stopped.

Measured in whole batches, one way after another, a round takes ~10 s a way at 16 streams, and
this machine's speed moves by 10% and more from one such stretch to the next: a 2% difference is
lost in it, nine rounds or not. Turns of three seconds did no better. Here each way's batch is
sent at once, and the engines take turns of `turn` seconds (a few decode steps): SIGCONT one,
wait, SIGSTOP it, the next, until every batch is done. So the ways of a round share the same
seconds of the machine, interleaved ten times a second. A stopped engine holds its requests where
they are; a step cut by a turn's end goes on at its next turn. A way's rate is its batch's tokens
over the time its engine ran, which holds its prefill, its decode steps and its last, whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

import psutil

from tools.harness import Server

__all__ = ["engine_cores", "interleaved", "stopped"]

T = TypeVar("T")
SENT = 0.2  # seconds for a batch's requests to reach its server


def engine_cores(server: Server) -> list[psutil.Process]:
    """vLLM's processes under `server` (its engine core, and workers where they are processes)."""
    found = [p for p in psutil.Process(server.process.pid).children(recursive=True) if p.name().startswith("VLLM::")]
    if not found:
        raise RuntimeError(f"{server.name}: no vLLM engine process under pid {server.process.pid}")
    return found


@contextlib.contextmanager
def stopped(groups: Sequence[Sequence[psutil.Process]]) -> Iterator[None]:
    """Every process in `groups` stopped, and all of them running again on leaving, whatever
    happened (a stopped engine would not stop on SIGTERM)."""
    try:
        _signal(groups, signal.SIGSTOP)
        yield
    finally:
        _signal(groups, signal.SIGCONT)


async def interleaved(
    groups: Sequence[Sequence[psutil.Process]],
    batches: Sequence[Awaitable[T]],
    finished: Callable[[T], float],
    turn: float,
) -> list[tuple[float, T]]:
    """Each batch driven against its group's engine, inside `stopped(groups)`: the engines run in
    turns of `turn` seconds, one at a time, each until its batch is done. Each batch's result, and
    its engine's seconds of running until the batch's `finished` moment (a perf_counter time:
    its last token, not the client's goodbye after it)."""
    tasks = [asyncio.ensure_future(batch) for batch in batches]
    turns: list[list[tuple[float, float]]] = [[] for _ in tasks]
    try:
        await asyncio.sleep(SENT)  # every batch's requests sent, so no engine's first turn waits for them
        while not all(task.done() for task in tasks):
            for group, task, taken in zip(groups, tasks, turns, strict=True):
                if task.done():
                    continue
                _signal([group], signal.SIGCONT)
                began = time.perf_counter()
                await asyncio.wait([task], timeout=turn)
                taken.append((began, time.perf_counter()))
                _signal([group], signal.SIGSTOP)
    finally:
        for task in tasks:
            task.cancel()
    out = []
    for task, taken in zip(tasks, turns, strict=True):
        end = finished(task.result())
        out.append((sum(max(0.0, min(ended, end) - began) for began, ended in taken), task.result()))
    return out


def _signal(groups: Sequence[Sequence[psutil.Process]], number: signal.Signals) -> None:
    """Send `number` to every process; for SIGSTOP, return once each has stopped (the signal is
    delivered asynchronously), so no two engines ever run in one turn."""
    processes = [process for group in groups for process in group]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(number)
    deadline = time.monotonic() + 5
    while number == signal.SIGSTOP and not all(map(_stopped, processes)):
        if time.monotonic() > deadline:
            raise RuntimeError("an engine process did not stop within 5 s of SIGSTOP")
        time.sleep(0.0005)


def _stopped(process: psutil.Process) -> bool:
    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
