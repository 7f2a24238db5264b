"""What a run counts: streams started, completed and lost; bad inputs and how they were answered."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field


@dataclass
class StreamTally:
    started: int = 0
    completed: int = 0
    lost: int = 0
    tokens: int = 0


@dataclass
class FaultTally:
    sent: int = 0
    specific: int = 0  # the error the input calls for, where the protocol puts it
    wrong: int = 0  # another error, no error, or the right one on the wrong channel
    unanswered: int = 0  # nothing within the timeout, or the connection dropped


@dataclass
class Tally:
    streams: defaultdict[str, StreamTally] = field(default_factory=lambda: defaultdict(StreamTally))
    faults: defaultdict[str, FaultTally] = field(default_factory=lambda: defaultdict(FaultTally))
    unexpected: Counter[str] = field(default_factory=Counter)  # errors on valid streams, by message
    problems: dict[str, list] = field(default_factory=dict)  # shape (digits masked) -> [count, first example]
    ttft_idle: list[float] = field(default_factory=list)
    ttft_loaded: list[float] = field(default_factory=list)
    dropped_connections: int = 0
    strays: int = 0
    tool_errors: int = 0  # jobs that raised: a connection refused, or a bug here

    def problem(self, text: str) -> None:
        """Note what went wrong; problems that differ only in their numbers are counted together."""
        self.problems.setdefault(re.sub(r"\d+", "N", text)[:90], [0, text])[0] += 1

    def start(self, kind: str) -> None:
        self.streams[kind].started += 1

    def complete(self, kind: str, tokens: int) -> None:
        self.streams[kind].completed += 1
        self.streams[kind].tokens += tokens

    def lose(self, kind: str, why: str, tokens: int = 0) -> None:
        self.streams[kind].lost += 1
        self.streams[kind].tokens += tokens
        self.problem(f"LOST {kind}: {why}")

    def fault(self, kind: str, verdict: str, detail: str = "") -> None:
        tally = self.faults[kind]
        tally.sent += 1
        setattr(tally, verdict, getattr(tally, verdict) + 1)
        if verdict != "specific":
            self.problem(f"WRONG {kind}: {verdict}: {detail}")

    @property
    def lost(self) -> int:
        return sum(t.lost for t in self.streams.values())

    @property
    def wrong(self) -> int:
        return sum(t.wrong + t.unanswered for t in self.faults.values())
