"""vLLM's processes forked from a server that has imported vLLM once, for a process that starts
many engines.

vLLM on CPU spawns its engine core (and data-parallel ranks, their coordinator): each spawned
process imports torch and vLLM afresh, about 8 of the 14-16 s a tiny model's start takes on two
cores. Forked instead from Python's fork server, which imported them at the first start, a later
start takes 3-4 s. The test suite starts ~40 engines this way (`EngineSettings.fork_server`);
`salience serve` starts one, so it spawns as vLLM does.

The fork server starts at the first engine's start, after vLLM has set the environment its
processes start in (the CPU platform's LD_PRELOAD and inductor settings among it), and never runs
a model itself, so no OpenMP pool is forked; it does compile vLLM's sampler op, one-threaded,
which saves each forked engine ~3 s more (sampler_warm_up.py). A process forked from it takes the
environment of the moment it is started, as a spawned one would: Salience's variables are scoped
to each start (environment.py).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext, ForkServerProcess

__all__ = ["forked_processes"]

# What the fork server imports once: the engine core and the CPU worker with everything they import.
_PRELOAD = [
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "salience.core.engine.worker_extension",
    "salience.core.engine.sampler_warm_up",
]
# vLLM's modules that start processes, each holding its own binding of get_mp_context.
_STARTERS = ("vllm.v1.engine.utils", "vllm.v1.engine.coordinator", "vllm.v1.executor.multiproc_executor")


class _Process(ForkServerProcess):
    """A fork server's process that runs in the environment of its start, not the fork server's."""

    def start(self) -> None:
        self._environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environment)
        super().run()


class _Context(ForkServerContext):
    Process = _Process


_CONTEXT = _Context()
_CONTEXT.set_forkserver_preload(_PRELOAD)


@contextlib.contextmanager
def forked_processes() -> Iterator[None]:
    """The processes vLLM starts while the body runs are forked from the fork server (vLLM's
    `get_mp_context` answers it); starts must not overlap."""
    modules = [importlib.import_module(name) for name in _STARTERS]
    saved = [module.get_mp_context for module in modules]
    for module in modules:
        module.get_mp_context = _context
    try:
        yield
    finally:
        for module, original in zip(modules, saved, strict=True):
            module.get_mp_context = original


def _context() -> _Context:
    return _CONTEXT
