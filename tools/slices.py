"""Servers measured in turns of a fraction of a second, each running while the others' engines are
stopped.

Measured in whole batches, one way after another, a round takes ~10 s a way at 16 streams, and
this machine's speed moves by 10% and more from one such stretch to the next: a 2% difference is
lost in it, nine rounds or not. Three-second turns did no better (rates from 23 to 31 tok/s one
turn to the next on one stream). Here every way's streams run all along and the engines take
turns of `turn` seconds (a few decode steps): SIGCONT one, SIGSTOP it, the next. A round runs
until each way has had `seconds` of turns, so the ways of a round share the same seconds of the
machine, interleaved ten times a second. A way's rate is the tokens its streams received in the
round over the time its engine ran: a stopped engine holds its requests where they are, a step
cut by a turn's end goes on at its next turn and counts in both, and the batches' prefills fall
in the rounds of both ways alike (their streams run in step, turn by turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator, Sequence

import psutil

from tools.harness import Server

__all__ = ["engine_cores", "interleaved_rates", "stopped"]


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


async def interleaved_rates(
    groups: Sequence[Sequence[psutil.Process]],
    arrivals: Sequence[list[float]],
    seconds: float,
    turn: float,
) -> list[float]:
    """One round inside `stopped(groups)`: the groups run in turns of `turn` seconds, one at a time,
    until each has run `seconds`; each one's tokens/s over its running time, from the arrival
    times its streams append to `arrivals`."""
    for times in arrivals:
        times.clear()
    ran = [0.0] * len(groups)
    while min(ran) < seconds:
        for i, group in enumerate(groups):
            _signal([group], signal.SIGCONT)
            began = time.perf_counter()
            await asyncio.sleep(turn)
            _signal([group], signal.SIGSTOP)
            ran[i] += time.perf_counter() - began
    await asyncio.sleep(0.05)  # what the last engine sent before it stopped arrives
    return [len(times) / seconds_run for times, seconds_run in zip(arrivals, ran, strict=True)]


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
