"""Build a folder at most once, atomically, even with several processes racing.

The folder is built in a scratch folder beside the target and renamed into
place under a file lock: whatever exists at the target path is complete, an
interrupted build leaves only scratch (removed on the next try), and a second
process waits for the first instead of building again, saying so while it waits
(a build takes minutes, and a start that hangs without a word looks broken).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["build_folder_once"]

log = logging.getLogger(__name__)

_WAIT_REPORT_EVERY = 15.0  # seconds between the lines a waiting process logs


def build_folder_once(target: Path, build: Callable[[Path], None]) -> Path:
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a+") as lock:
        _lock(lock, target)
        if target.is_dir():  # built by another process while we waited
            return target
        lock.truncate(0)
        lock.write(str(os.getpid()))  # for the message of a process that waits
        lock.flush()
        for stale in target.parent.glob(f".{target.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
        try:
            build(scratch)
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _lock(lock: IO[str], target: Path, poll: float = 0.5) -> None:
    """Take the lock; while another process holds it, log who builds what, every so often."""
    began = time.monotonic()
    said = None
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = time.monotonic() - began
            if said is None or waited - said >= _WAIT_REPORT_EVERY:
                said = waited
                lock.seek(0)
                builder = lock.read().strip() or "?"
                log.info(
                    "waiting for another process to build %s: %.0f s so far",
                    target.name,
                    waited,
                    extra={"builder_pid": builder, "folder": str(target)},
                )
            time.sleep(poll)
            continue
        if said is not None:
            log.info("the other build of %s ended after %.0f s", target.name, time.monotonic() - began)
        return
