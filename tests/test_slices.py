"""tools/slices.py, on stand-in engines: real processes stopped and continued by signal, and
producers that deliver a step's tokens for every so many seconds their process ran."""

from __future__ import annotations

import asyncio
import subprocess
import time

import psutil
import pytest

from tools.slices import interleaved_rates, stopped

TOKENS = 4  # a step's tokens: one per stream


async def test_each_engine_runs_alone_in_its_turns_and_its_rate_is_measured() -> None:
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    groups = [[psutil.Process(p.pid)] for p in sleepers]
    step = [0.02, 0.04]  # seconds a step: 200 and 100 tokens/s
    arrivals: list[list[float]] = [[], []]
    together = []  # moments both ran

    def running(group: list[psutil.Process]) -> bool:
        return group[0].status() != psutil.STATUS_STOPPED

    async def produce(i: int) -> None:
        """A step's tokens for every `step[i]` seconds its process ran (a stopped engine's step waits)."""
        done, last = 0.0, time.perf_counter()
        while True:
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            if running(groups[i]):
                done += now - last
                if running(groups[1 - i]):
                    together.append(i)
            while done >= step[i]:
                done -= step[i]
                arrivals[i].extend([now] * TOKENS)
            last = now

    try:
        with stopped(groups):
            assert not any(map(running, groups))
            producers = [asyncio.create_task(produce(i)) for i in range(2)]
            try:
                rates = await interleaved_rates(groups, arrivals, 0.6, turn=0.1)
            finally:
                for producer in producers:
                    producer.cancel()
        assert all(map(running, groups)), "every engine runs again after the rounds"
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert not together
    assert rates[0] == pytest.approx(TOKENS / step[0], rel=0.15)
    assert rates[1] == pytest.approx(TOKENS / step[1], rel=0.15)
