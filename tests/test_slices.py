"""tools/slices.py, on stand-in engines: real processes stopped and continued by signal, and
producers that deliver bursts of tokens at a known rate only while their process runs."""

from __future__ import annotations

import asyncio
import subprocess
import time

import psutil
import pytest

from tools.slices import slice_rates, stopped

TOKENS = 4  # a step's tokens: one per stream


async def test_each_engine_runs_alone_in_its_slice_and_its_rate_is_measured() -> None:
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    groups = [[psutil.Process(p.pid)] for p in sleepers]
    step = [0.02, 0.04]  # seconds a step: 200 and 100 tokens/s
    arrivals: list[list[float]] = [[], []]
    together = []  # moments both ran

    def running(group: list[psutil.Process]) -> bool:
        return group[0].status() != psutil.STATUS_STOPPED

    async def produce(i: int) -> None:
        while True:
            await asyncio.sleep(step[i])
            if running(groups[i]):
                arrivals[i].extend([time.perf_counter()] * TOKENS)
                if running(groups[1 - i]):
                    together.append(i)

    try:
        with stopped(groups):
            assert not any(map(running, groups))
            producers = [asyncio.create_task(produce(i)) for i in range(2)]
            try:
                rates = await slice_rates(groups, arrivals, 0.6, settle=0.1)
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


async def test_a_slice_too_short_for_two_steps_says_so() -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        group = [psutil.Process(sleeper.pid)]
        with stopped([group]), pytest.raises(RuntimeError, match="make the slices longer"):
            await slice_rates([group], [[]], 0.1, settle=0.0)
    finally:
        sleeper.kill()
        sleeper.wait()
