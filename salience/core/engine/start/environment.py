"""The process environment vLLM starts in: the platform, and the variables its processes read at
start (their layout, the CPU KV cache, each rank's cores). They are read once, at start, so they
are set only around it (`scoped`) and the next engine starts clean."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from salience.errors import ModelError

if TYPE_CHECKING:
    from salience.core.engine.settings import EngineSettings

__all__ = ["is_cpu", "process_environment", "scoped", "split_cores"]


def is_cpu() -> bool:
    """Whether vLLM runs on its CPU platform, which most of a start's decisions depend on."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def process_environment(settings: EngineSettings, cpu: bool) -> dict[str, str | None]:
    """What vLLM's processes read from the environment at start, for these settings (None: unset)."""
    multiprocess = settings.multiprocess if settings.multiprocess is not None else not cpu
    multiprocess = multiprocess or settings.data_parallel_size > 1  # DP engines are processes
    env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
    if settings.ray_address is not None:
        env["RAY_ADDRESS"] = settings.ray_address  # vLLM's ray.init() joins the cluster it names
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = None  # the size goes in vLLM's engine arguments (vllm_args.py)
        ranks = settings.tensor_parallel_size * settings.pipeline_parallel_size * settings.data_parallel_size
        on_ray = settings.distributed_executor_backend == "ray"  # workers on Ray nodes: not bound
        if ranks > 1 and not on_ray and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # vllm-cpu binds each rank (DP x PP x TP on this node) to a NUMA node; on one node
            # it refuses to start unless told which cores each rank gets.
            env["VLLM_CPU_OMP_THREADS_BIND"] = split_cores(ranks)
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


@contextlib.contextmanager
def scoped(values: dict[str, str | None]) -> Iterator[None]:
    """`values` in os.environ while the body runs (None: unset), what was there before restored after."""
    saved = {key: os.environ.get(key) for key in values}
    _set(values)
    try:
        yield
    finally:
        _set(saved)


def _set(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def split_cores(ranks: int) -> str:
    """The allowed cores in `ranks` contiguous groups, in VLLM_CPU_OMP_THREADS_BIND's syntax ("0|1")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ModelError(f"{ranks} ranks (tensor x pipeline parallel) need {ranks} cores; {len(cores)} are available")
    size = len(cores) // ranks
    groups = [cores[i * size : (i + 1) * size] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
