"""One engine per configuration for the whole test run.

An engine start costs 10-25 s (more when compiled), and most modules ask for one of a few
configurations: the pool starts each once and hands it to every module that asks for the same
settings. The fixtures that ask for a configuration name themselves, and conftest's `Plan` knows
which tests are left: an engine no module holds stays up while a test still to run uses one of
them, and goes as soon as none does. At most `keep` stay idle, and a start first makes room (on a
machine shared with other work) until `room_gib` of memory is available; either way the engine
whose next use is furthest goes first, so a run's memory stays bounded whatever order modules run in.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from salience.core.engine.engine import Engine
from salience.core.engine.settings import EngineSettings

log = logging.getLogger(__name__)


async def settled(engine: Engine, seconds: float = 5.0) -> int:
    """The requests vLLM still holds once an abort has had up to `seconds` to land (it takes a
    step or two): 0 unless something was left running."""
    for _ in range(int(seconds / 0.05)):
        if engine.num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    return engine.num_unfinished_requests()


def engine_settings(model: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` with what every test engine has unless it says otherwise: a small KV cache, and
    its processes forked from the fork server (~8 s off every start after the first)."""
    return {"served_model_name": model.name, "kv_cache_gib": 1.0, "fork_server": True} | settings


def _part(value: Any) -> str:
    """A setting as part of a key: values by value, other objects (concept sets, SAEs) by identity,
    which the pool keeps alive beside the engine so that no other object can take their id."""
    if value is None or isinstance(value, str | int | float | bool | Path):
        return repr(value)
    if isinstance(value, tuple | list):
        return "(" + ",".join(_part(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_part(v)}" for k, v in sorted(value.items())) + "}"
    return f"{type(value).__name__}@{id(value):x}"


@dataclass
class _Pooled:
    engine: Engine
    settings: dict[str, Any]  # held so the objects the key names by id stay alive
    users: int = 0
    fixtures: set[str] = field(default_factory=set)  # the fixtures that ask for it, "name" or "name[param]"
    last_test: str = ""  # the test that last let go of it


@dataclass
class EnginePool:
    keep: int  # idle engines at most
    room_gib: float = 0.0  # memory a start wants available: idle engines go until it is
    # The place in the run of the next test using one of these fixtures, math.inf if none is left
    # (conftest's Plan); without a plan every engine is wanted, and the least recently used goes first.
    next_use: Callable[[Collection[str]], float] = lambda fixtures: 0.0
    starts: list[str] = field(default_factory=list)  # every configuration started, in order
    seconds: list[float] = field(default_factory=list)  # how long each of `starts` took
    labels: list[str] = field(default_factory=list)  # each of `starts` as a person reads it
    events: list[str] = field(default_factory=list)  # starts and shutdowns, with the test running then
    running: Callable[[], str] = lambda: ""  # the test running now (conftest's Plan)
    _engines: dict[str, _Pooled] = field(default_factory=dict)  # least recently used first

    @asynccontextmanager
    async def engine(self, model: Path, fixtures: Collection[str] = (), **settings: Any) -> AsyncIterator[Engine]:
        """The engine for these settings, started on first use; the caller must leave it as it
        found it (live concepts deleted, no request running). `fixtures` names every fixture
        that asks for these settings ("name", or "name[param]" for one parameter of it): once no
        test still to run uses one, the engine shuts down. Unnamed, it stays up until `keep` or
        `room_gib` needs its place."""
        settings = engine_settings(model, settings)
        key = _part({"model": model, **settings})
        pooled = self._engines.pop(key, None)
        if pooled is not None and pooled.users == 0 and pooled.engine.llm.errored:
            # A dead engine fails the module that killed it, not every later module that shares it;
            # the summary names where it was found (the cause is in that module's captured output).
            self._event(f"found stopped (last let go of by {pooled.last_test or 'none'}); starting again", key)
            pooled.engine.shutdown()
            pooled = None
        if pooled is None:
            self._evict(self.keep - 1)
            while self._available_gib() < self.room_gib and self._evict_one():
                pass
            started = time.monotonic()
            pooled = _Pooled(await Engine.start(EngineSettings(model=model, **settings)), settings)
            self.starts.append(key)
            self.seconds.append(time.monotonic() - started)
            mode = "compiled" if settings.get("compile") else "eager"
            self.labels.append(f"{model.name}, {mode}, for {', '.join(sorted(fixtures)) or self.running()}")
            self._event("started", key)
        self._engines[key] = pooled
        pooled.users += 1
        pooled.fixtures.update(fixtures)
        try:
            yield pooled.engine
        finally:
            pooled.users -= 1
            pooled.last_test = self.running()
            self._engines[key] = self._engines.pop(key)  # most recently used last
            assert await settled(pooled.engine) == 0, f"a module left requests running on {key}"
            table = pooled.engine.live.table  # None without a concept set
            assert table is None or not table.live(), f"a module left live concepts on {key}"
            self._evict(self.keep)

    def _next_use(self, pooled: _Pooled) -> float:
        return self.next_use(pooled.fixtures) if pooled.fixtures else 0.0  # unnamed: wanted

    def _evict(self, idle: int) -> None:
        """Shut down the idle engines no test still to run asks for, then those used furthest
        ahead until at most `idle` remain."""
        for key in [k for k, p in self._engines.items() if p.users == 0 and self._next_use(p) == math.inf]:
            self._engines.pop(key).engine.shutdown()
            self._event("no longer wanted", key)
        while sum(1 for p in self._engines.values() if p.users == 0) > idle:
            self._evict_one()

    def _evict_one(self) -> bool:
        """Shut down the idle engine used furthest ahead (of equals, the least recently used)."""
        waiting = [(-self._next_use(p), i, key) for i, (key, p) in enumerate(self._engines.items()) if p.users == 0]
        if not waiting:
            return False
        key = min(waiting)[2]
        self._engines.pop(key).engine.shutdown()
        self._event("evicted", key)
        return True

    def _event(self, what: str, key: str) -> None:
        test, available = self.running(), self._available_gib()
        log.info(f"test engine {what}", extra={"engine": key, "test": test})
        self.events.append(f"{what}: {key} (during {test}, {available:.1f} GiB available)")

    @staticmethod
    def _available_gib() -> float:
        return psutil.virtual_memory().available / 2**30

    def close(self) -> None:
        for pooled in self._engines.values():
            pooled.engine.shutdown()
        self._engines.clear()
