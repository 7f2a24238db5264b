"""A command ends only after every process it started has ended.

vLLM's shutdown asks its engine core to stop but does not wait for it, and two of Python's own
helpers outlive the process that started them: the fork server (fork_server.py), which exits
once it reads the end of its pipe, that is after its starter has exited, and the engine core
forked from it; and multiprocessing's resource tracker, likewise. A server that had exited 0 left
them holding memory for 3-7 s, so a supervisor, a test or a rolling deploy restarting it at once
found an orphan. `end_children` runs as a command ends, once its engine is shut down, and returns
when they are all gone: what is still running ends on its own, then by SIGTERM, then by SIGKILL.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.forkserver
import multiprocessing.resource_tracker

import psutil

__all__ = ["end_children"]

log = logging.getLogger(__name__)


def end_children(grace: float = 10.0) -> None:
    """Wait up to `grace` s for every process this one started (the fork server's children too)
    to end, SIGTERM and then SIGKILL what is left, then stop the fork server and the resource
    tracker, reaping each."""
    me = psutil.Process()
    helpers = {_pid(multiprocessing.forkserver._forkserver), _pid(multiprocessing.resource_tracker._resource_tracker)}
    # The fork server's children first, while it still runs to reap them: once it is gone they
    # would be re-parented to init, out of our reach. The two helpers end only when told.
    others = [p for p in _descendants(me) if p.pid not in helpers]
    _end(others, grace)
    with contextlib.suppress(OSError, ChildProcessError):
        multiprocessing.forkserver._forkserver._stop()  # closes its pipe and waits for it
    with contextlib.suppress(OSError, ChildProcessError):
        multiprocessing.resource_tracker._resource_tracker._stop()
    _end(_descendants(me), grace)  # anything else, such as a fork server that would not stop


def _end(processes: list[psutil.Process], grace: float) -> None:
    if not processes:
        return
    _, alive = psutil.wait_procs(processes, timeout=grace)
    for signal_name in ("terminate", "kill"):
        if not alive:
            return
        log.warning(
            "child processes still running at exit: %s",
            signal_name,
            extra={"pids": [p.pid for p in alive], "names": [_name(p) for p in alive]},
        )
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                getattr(process, signal_name)()
        _, alive = psutil.wait_procs(alive, timeout=grace)


def _descendants(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _pid(helper: object) -> int | None:
    """The pid of the fork server or the resource tracker, None unless started."""
    return getattr(helper, "_forkserver_pid", None) or getattr(helper, "_pid", None)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return "?"
