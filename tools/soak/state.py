"""The model as MODEL_INFO describes it, and the run's state every job sees."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tools.soak.connection import Connection
from tools.soak.options import SoakOptions
from tools.soak.server import Server
from tools.soak.tally import Tally


@dataclass(frozen=True)
class Model:
    name: str
    vocab_size: int
    max_model_len: int
    readout_width: int  # floats per readout; 0 without a concept set

    @classmethod
    def from_info(cls, info: dict) -> Model:
        manifest = info.get("readout_manifest")
        width = len(manifest["concepts"]) * len(manifest["layers"]) if manifest else 0
        return cls(info["model"], info["vocab_size"], info["max_model_len"], width)

    def prompt(self, rng: random.Random, low: int = 4, high: int = 48) -> list[int]:
        floor = min(100, self.vocab_size // 4)
        return [rng.randrange(floor, self.vocab_size) for _ in range(rng.randint(low, high))]


@dataclass
class Soak:
    options: SoakOptions
    server: Server
    model: Model
    tally: Tally = field(default_factory=Tally)
    deadline: float = 0.0
    started_at: float = 0.0

    @property
    def tokens(self) -> int:
        return self.options.tokens

    @property
    def long_tokens(self) -> int:
        return 4 * self.options.tokens

    @property
    def timeout(self) -> float:
        return self.options.stream_timeout

    def running(self) -> bool:
        return time.monotonic() < self.deadline and self.server.alive()


Job = Callable[[Soak, Connection, random.Random], Awaitable[None]]
