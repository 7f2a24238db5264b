"""The server's lifecycle, shared by every frontend: loading, ready, draining, stopping.

Every stream a frontend runs is admitted here (`admit`), so the server knows what is in
flight: draining refuses new streams while the admitted ones keep their engine, and waits
(`wait_idle`) until they have ended. Admission also holds each client to its limit on streams
running at once, summed over its connections and frontends.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections import Counter
from collections.abc import Iterable

from salience.core.engine.engine import Engine
from salience.core.serving.observers import OBSERVERS
from salience.errors import InvalidArgument, ResourceExhausted, Unavailable

__all__ = ["Admitted", "Phase", "ServerStatus"]

# What a client past its stream limit is told to wait: a stream of its own must end first, which
# the server cannot foresee; a second is a short wait for a client whose streams are short.
STREAM_RETRY_SECONDS = 1.0


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"  # in-flight streams finish; new ones are refused
    STOPPING = "stopping"


class Admitted:
    """A stream admitted to run: its engine, counted in flight until `end`.

    As a context manager it ends the stream on exit if the body did not: `cancelled`
    when the body was cancelled, `error` when it raised."""

    def __init__(self, status: ServerStatus, engine: Engine, frontend: str, kind: str, client: str | None) -> None:
        self.engine = engine
        self.frontend = frontend
        self.kind = kind
        self.client = client
        self.ended = False
        self._status = status
        OBSERVERS.stream_admitted(frontend, kind, client)

    def end(self, finish_reason: str) -> None:
        """`stop`, `length`, `cancelled` or `error`; only the first call counts."""
        if not self.ended:
            self.ended = True
            OBSERVERS.stream_ended(self.frontend, self.kind, finish_reason)
            self._status._stream_ended(self.client)

    def __enter__(self) -> Admitted:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> None:
        if kind is not None:
            self.end("cancelled" if issubclass(kind, (asyncio.CancelledError, GeneratorExit)) else "error")
        else:
            self.end("cancelled")


class ServerStatus:
    """Frontends start before the engine is loaded so they can say so."""

    def __init__(self, model_name: str, aliases: Iterable[str] = ()) -> None:
        self.model_name = model_name
        self.model_names = frozenset({model_name, *aliases})  # names a request may use
        self.phase = Phase.LOADING
        self.engine: Engine | None = None
        self.changed = asyncio.Event()
        self.in_flight = 0  # admitted streams that have not ended
        self._running: Counter[str] = Counter()  # the same, by client
        self._idle = asyncio.Event()
        self._idle.set()

    def ready(self, engine: Engine) -> None:
        self.engine = engine
        OBSERVERS.budget_opened(engine.row_budget)
        self._set(Phase.READY)

    def serving_engine(self) -> Engine:
        """The engine, or Unavailable saying why requests cannot run now."""
        if self.phase is Phase.LOADING:
            raise Unavailable("the model is still loading; retry in a few seconds")
        if self.phase is Phase.DRAINING:
            raise Unavailable("the server is draining; retry on another instance (requests in flight are finishing)")
        if self.phase is Phase.STOPPING or self.engine is None:
            raise Unavailable("the server is shutting down")
        return self.engine

    def admit(
        self,
        frontend: str,
        kind: str,
        client: str | None = None,
        max_streams: int | None = None,
        tokens_per_minute: int | None = None,
    ) -> Admitted:
        """Admit a stream (`kind`: generate, score, session_generate) of `client` (None: of the
        server itself), or raise Unavailable, or ResourceExhausted when the client already runs
        `max_streams` or has had `tokens_per_minute` generated over the last minute."""
        engine = self.serving_engine()
        if client is not None and max_streams is not None and self._running[client] >= max_streams:
            raise ResourceExhausted(
                f"client {client!r} runs {self._running[client]} streams, its limit: "
                f"retry when one has ended (in about {STREAM_RETRY_SECONDS:g} s)",
                retry_after=STREAM_RETRY_SECONDS,
            )
        if client is not None and tokens_per_minute is not None:
            wait = engine.meter.wait(client, tokens_per_minute)
            if wait > 0:
                raise ResourceExhausted(
                    f"client {client!r} has had {engine.meter.recent(client)} tokens generated over the last "
                    f"minute, its limit is {tokens_per_minute}: retry in {math.ceil(wait)} s",
                    retry_after=wait,
                )
        self.in_flight += 1
        if client is not None:
            self._running[client] += 1
        self._idle.clear()
        return Admitted(self, engine, frontend, kind, client)

    def _stream_ended(self, client: str | None) -> None:
        if client is not None:
            self._running[client] -= 1
            if not self._running[client]:
                del self._running[client]
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float | None = None) -> bool:
        """Until no admitted stream is running; False if `timeout` seconds passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def check_model(self, model: str | None) -> None:
        """A request naming a model (None: it names none) must name the served one."""
        if model is not None and model not in self.model_names:
            raise InvalidArgument(
                f"model {model!r} is not served here; this server serves {self.model_name!r}", field="model"
            )

    def draining(self) -> None:
        self._set(Phase.DRAINING)

    def stopping(self) -> None:
        self._set(Phase.STOPPING)

    def _set(self, phase: Phase) -> None:
        self.phase = phase
        self.changed.set()
        self.changed = asyncio.Event()
