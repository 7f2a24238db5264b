"""Servers measured in turns of a few seconds, each running while the others' engines are stopped.

Measured in whole batches, one way after another, a round takes ~10 s per way at 16 streams, and
this machine's speed moves by up to 10% between two such rounds: a 2% difference is lost in it,
nine rounds or not. Here every way's streams run all along, and the engines take turns: in each
slice one way's engine core runs and the others' are stopped (SIGSTOP), so the ways of a round
are measured seconds apart, and a run holds many more rounds. A stopped engine holds its
requests where they are; its server and client wait, idle. Each slice's rate is taken from the
tokens that arrived in it, after a settling time (the step the engine was stopped in ends first):
the tokens of every step after the first, over the time from the first step's arrival to the
last one's, so no step is cut at either end.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator, Sequence

import psutil

from tools.harness import Server

__all__ = ["engine_cores", "slice_rates", "stopped"]

# A step's tokens reach the client within this of each other, steps (tens of ms on the default
# model) further apart: how the first step's tokens are told from the second's.
BURST = 0.01


def engine_cores(server: Server) -> list[psutil.Process]:
    """vLLM's engine core processes under `server` (with their workers: every process vLLM names)."""
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


async def slice_rates(
    groups: Sequence[Sequence[psutil.Process]],
    arrivals: Sequence[list[float]],
    seconds: float,
    settle: float,
) -> list[float]:
    """One round inside `stopped(groups)`: each group's engine runs for `seconds` in turn, and the
    tokens/s its streams received (their arrival times in `arrivals`, appended as they come)."""
    rates = []
    for group, times in zip(groups, arrivals, strict=True):
        _signal([group], signal.SIGCONT)
        began = time.perf_counter()
        await asyncio.sleep(seconds)
        _signal([group], signal.SIGSTOP)
        ended = time.perf_counter()
        await asyncio.sleep(0.05)  # what the engine sent before it stopped arrives
        inside = [t for t in times if began + settle <= t <= ended]
        times.clear()
        first = sum(1 for t in inside if t <= inside[0] + BURST) if inside else 0
        if len(inside) <= first:
            raise RuntimeError(f"{len(inside)} tokens in a {seconds} s slice: make the slices longer")
        rates.append((len(inside) - first) / (inside[-1] - inside[0]))
    return rates


def _signal(groups: Sequence[Sequence[psutil.Process]], number: signal.Signals) -> None:
    """Send `number` to every process; for SIGSTOP, return once each has stopped (the signal is
    delivered asynchronously), so no two engines ever run in one slice."""
    processes = [process for group in groups for process in group]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(number)
    deadline = time.monotonic() + 5
    while number == signal.SIGSTOP and not all(map(_stopped, processes)):
        if time.monotonic() > deadline:
            raise RuntimeError("an engine process did not stop within 5 s of SIGSTOP")
        time.sleep(0.001)


def _stopped(process: psutil.Process) -> bool:
    try:
        return process.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
