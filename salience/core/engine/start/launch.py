"""Launching vLLM: its AsyncLLM started from the engine arguments (vllm_args.py) in the process
environment they need (environment.py), logging progress while it loads: a first compile takes
minutes, and a silent start looks hung."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

from salience.core.engine.start import environment
from salience.core.engine.start.fork_server import forked_processes

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["start_vllm"]

log = logging.getLogger(__name__)


async def start_vllm(args: AsyncEngineArgs, env: dict[str, str | None], compiled: bool, fork_server: bool) -> AsyncLLM:
    """vLLM's engine for `args`, started with `env` set (`compiled`: what the progress lines say),
    its processes forked from the fork server if `fork_server` (fork_server.py)."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    what = "loading and compiling the model (a first start compiles; later ones reuse the cache)"
    # vLLM's processes read these at start; scoped so the next engine starts clean.
    with (
        environment.scoped(env),
        forked_processes() if fork_server else contextlib.nullcontext(),
        _inspected_in_process() if environment.is_cpu() else contextlib.nullcontext(),
    ):
        # Loading takes tens of seconds, compiling minutes: keep the event loop free (health
        # checks). The engine core sends its stats back with its outputs, so the Prometheus
        # logger lives in this process (registering into prometheus_client's default
        # registry) whichever process layout runs the worker.
        async with _progress(what if compiled else "loading the model"):
            return await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[PrometheusStatLogger])


@contextlib.contextmanager
def _inspected_in_process() -> Iterator[None]:
    """vLLM inspects a model class it has not cached (vllm/model_executor/models/registry.py,
    `_run_in_subprocess`) in a new Python process "to avoid initializing CUDA": 10-15 s of
    importing vLLM again, on every first start of an architecture. On the CPU platform there is no
    CUDA to keep uninitialized, and this process has vLLM imported: inspect here."""
    from vllm.model_executor.models import registry

    in_subprocess = registry._run_in_subprocess
    registry._run_in_subprocess = lambda inspect: inspect()
    try:
        yield
    finally:
        registry._run_in_subprocess = in_subprocess


@contextlib.asynccontextmanager
async def _progress(what: str, every: float = 15.0) -> AsyncIterator[None]:
    """Log a line every `every` seconds while the body runs: a first compile takes minutes."""
    started = time.monotonic()

    async def tick() -> None:
        while True:
            await asyncio.sleep(every)
            log.info("%s: %.0f s so far", what, time.monotonic() - started)

    ticker = asyncio.create_task(tick())
    try:
        yield
    finally:
        ticker.cancel()
