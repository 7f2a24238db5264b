"""vLLM's engine processes end with the server that started them, however it ends.

vLLM's engine core outlives a server killed by SIGKILL (the OOM killer, `kill -9`, a supervisor's
forced stop): it runs on, holding the model and its KV cache, for good (vllm-project/vllm#55510;
its workers watch the engine core, but the engine core watches nothing). So each worker watches
the server's process: once it is gone (or a zombie), the worker ends its own process and, when
the process that started it is not the server, that one too (the engine core of the multiprocess
layout), with SIGTERM, vLLM's own shutdown, then SIGKILL if that has not ended them. Not on Ray,
whose workers run on other machines. A process forked from the fork server (fork_server.py) is
its child, not its starter's: `fork_server.starter` knows which.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import psutil

from salience.core.engine.start.fork_server import starter

__all__ = ["watch_server"]

log = logging.getLogger(__name__)


def watch_server(pid: int, every: float = 1.0, grace: float = 5.0) -> None:
    """From a worker: end this engine once process `pid` (the server) is gone, checking every `every` s."""
    started_by = starter()
    engine = [os.getpid()] if started_by == pid else [started_by, os.getpid()]  # the engine core first
    try:
        created = psutil.Process(pid).create_time()  # a later process under the same pid is not the server
    except psutil.NoSuchProcess:
        created = None
    thread = threading.Thread(
        target=_watch, args=(pid, created, engine, every, grace), name="salience-server-watch", daemon=True
    )
    thread.start()


def _watch(pid: int, created: float | None, engine: list[int], every: float, grace: float) -> None:
    while _alive(pid, created):
        time.sleep(every)
    log.warning("the server process %d is gone: stopping its engine", pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for target in engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, sig)
        time.sleep(grace)


def _alive(pid: int, created: float | None) -> bool:
    if created is None:
        return False
    try:
        process = psutil.Process(pid)
        return process.create_time() == created and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
