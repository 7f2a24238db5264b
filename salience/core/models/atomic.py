"""Build a folder at most once, atomically, even with several processes racing.

The folder is built in a scratch folder beside the target and renamed into
place under a file lock: whatever exists at the target path is complete, an
interrupted build leaves only scratch (removed on the next try), and a second
process waits for the first instead of building again.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_folder_once"]


def build_folder_once(target: Path, build: Callable[[Path], None]) -> Path:
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # built by another process while we waited
            return target
        for stale in target.parent.glob(f".{target.name}.tmp*"):
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp", dir=target.parent))
        try:
            build(scratch)
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target
