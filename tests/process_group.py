"""What is left of a command's process group once its exit status is known: nothing, when the
command ends every process it started (salience/core/engine/start/children.py). The command must be
started in a session of its own (`start_new_session=True`), so its group is its pid."""

from __future__ import annotations

import os

import psutil

__all__ = ["left_in_group"]


def left_in_group(pgid: int) -> list[str]:
    """Every live process of group `pgid`, as "pid name" (zombies included: nobody reaped them)."""
    left = []
    for process in psutil.process_iter(["name"]):
        try:
            if os.getpgid(process.pid) == pgid:
                left.append(f"{process.pid} {process.info['name']} ({process.status()})")
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return left
