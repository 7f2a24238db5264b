"""The server's lifecycle, shared by every frontend: loading, ready, stopping."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable

from salience.core.engine import Engine
from salience.errors import InvalidArgument, Unavailable

__all__ = ["Phase", "ServerStatus"]


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    STOPPING = "stopping"


class ServerStatus:
    """Frontends start before the engine is loaded so they can say so."""

    def __init__(self, model_name: str, aliases: Iterable[str] = ()) -> None:
        self.model_name = model_name
        self.model_names = frozenset({model_name, *aliases})  # names a request may use
        self.phase = Phase.LOADING
        self.engine: Engine | None = None
        self.changed = asyncio.Event()

    def ready(self, engine: Engine) -> None:
        self.engine = engine
        self._set(Phase.READY)

    def serving_engine(self) -> Engine:
        """The engine, or Unavailable saying why requests cannot run now."""
        if self.phase is Phase.LOADING:
            raise Unavailable("the model is still loading; retry in a few seconds")
        if self.phase is Phase.STOPPING or self.engine is None:
            raise Unavailable("the server is shutting down")
        return self.engine

    def check_model(self, model: str | None) -> None:
        """A request naming a model (None: it names none) must name the served one."""
        if model is not None and model not in self.model_names:
            raise InvalidArgument(f"model {model!r} is not served here; this server serves {self.model_name!r}")

    def stopping(self) -> None:
        self._set(Phase.STOPPING)

    def _set(self, phase: Phase) -> None:
        self.phase = phase
        self.changed.set()
        self.changed = asyncio.Event()
