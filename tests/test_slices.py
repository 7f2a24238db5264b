"""tools/slices.py, on stand-in engines: real processes stopped and continued by signal, and
batches that take a step for every so many seconds their process ran."""

from __future__ import annotations

import asyncio
import subprocess
import time

import psutil
import pytest

from tools.slices import interleaved, stopped


async def test_engines_take_turns_alone_and_each_batch_is_timed_by_its_running() -> None:
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    groups = [[psutil.Process(p.pid)] for p in sleepers]
    together = []  # moments both ran

    def running(i: int) -> bool:
        return groups[i][0].status() != psutil.STATUS_STOPPED

    async def batch(i: int, steps: int, step: float) -> tuple[float, str]:
        """`steps` steps of `step` seconds of its process's running (a stopped engine's step waits)."""
        done, last = 0.0, time.perf_counter()
        while done < steps * step:
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            if running(i):
                done += now - last
                if running(1 - i):
                    together.append(i)
            last = now
        finished = time.perf_counter()
        await asyncio.sleep(0.3)  # a goodbye after the last token: not the engine's running
        return finished, f"batch {i}"

    try:
        with stopped(groups):
            assert not running(0) and not running(1)
            batches = [batch(0, 20, 0.02), batch(1, 10, 0.06)]
            done = await interleaved(groups, batches, lambda result: result[0], turn=0.1)
        assert running(0) and running(1), "every engine runs again after the rounds"
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert not together
    assert [result[1] for _, result in done] == ["batch 0", "batch 1"]
    assert done[0][0] == pytest.approx(0.4, rel=0.2)
    assert done[1][0] == pytest.approx(0.6, rel=0.2)
