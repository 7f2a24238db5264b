"""The server's lifecycle, shared by every frontend: loading, ready, stopping."""

from __future__ import annotations

import asyncio
import enum

from salience.core.engine import Engine

__all__ = ["Phase", "ServerStatus"]


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"


class ServerStatus:
    """Frontends start before the engine is loaded so they can say so."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.phase = Phase.LOADING
        self.engine: Engine | None = None
        self.changed = asyncio.Event()

    def ready(self, engine: Engine) -> None:
        self.engine = engine
        self._set(Phase.READY)

    def stopping(self) -> None:
        self._set(Phase.STOPPING)

    def _set(self, phase: Phase) -> None:
        self.phase = phase
        self.changed.set()
        self.changed = asyncio.Event()
