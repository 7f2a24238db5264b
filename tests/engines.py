"""One engine per configuration for the whole test run.

An engine start costs 10-25 s (more when compiled), and most modules ask for one of a few
configurations: the pool starts each once and hands it to every module that asks for the same
settings. Engines no module holds stay up, the most recently used first, until more than `keep`
are idle; a test run's memory stays bounded whatever order modules run in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class EnginePool:
    keep: int
    starts: list[str] = field(default_factory=list)  # every configuration started, in order
    _engines: dict[str, _Pooled] = field(default_factory=dict)  # least recently used first

    @asynccontextmanager
    async def engine(self, model: Path, **settings: Any) -> AsyncIterator[Engine]:
        """The engine for these settings, started on first use; the caller must leave it as it
        found it (live concepts deleted, no request running)."""
        settings.setdefault("served_model_name", model.name)
        settings.setdefault("kv_cache_gib", 1.0)
        key = _part({"model": model, **settings})
        pooled = self._engines.pop(key, None)
        if pooled is None:
            self._evict(self.keep - 1)
            pooled = _Pooled(await Engine.start(EngineSettings(model=model, **settings)), settings)
            self.starts.append(key)
            log.info("test engine started", extra={"engine": key, "starts": len(self.starts)})
        self._engines[key] = pooled
        pooled.users += 1
        try:
            yield pooled.engine
        finally:
            pooled.users -= 1
            self._engines[key] = self._engines.pop(key)  # most recently used last
            assert await settled(pooled.engine) == 0, f"a module left requests running on {key}"
            table = pooled.engine.live.table  # None without a concept set
            assert table is None or not table.live(), f"a module left live concepts on {key}"
            self._evict(self.keep)

    def _evict(self, idle: int) -> None:
        """Shut down the least recently used idle engines until at most `idle` remain."""
        waiting = [key for key, pooled in self._engines.items() if pooled.users == 0]
        for key in waiting[: max(0, len(waiting) - idle)]:
            self._engines.pop(key).engine.shutdown()

    def close(self) -> None:
        for pooled in self._engines.values():
            pooled.engine.shutdown()
        self._engines.clear()
