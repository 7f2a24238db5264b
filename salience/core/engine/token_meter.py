"""Generated tokens per client over the last minute: what a client's `tokens_per_minute` limit is
held to. Counted as the engine decodes them, in one-second buckets, so a client's record is at
most sixty numbers however fast it generates."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

__all__ = ["WINDOW_SECONDS", "TokenMeter"]

WINDOW_SECONDS = 60.0


class TokenMeter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, deque[list[int]]] = {}  # client -> [[second, tokens], ...], oldest first

    def add(self, client: str, tokens: int) -> None:
        second = math.floor(self._clock())
        buckets = self._buckets.setdefault(client, deque())
        if buckets and buckets[-1][0] == second:
            buckets[-1][1] += tokens
        else:
            buckets.append([second, tokens])
        self._prune(client, buckets)

    def recent(self, client: str) -> int:
        """The client's generated tokens over the last WINDOW_SECONDS."""
        buckets = self._buckets.get(client)
        if buckets is None:
            return 0
        self._prune(client, buckets)
        return sum(tokens for _, tokens in buckets)

    def wait(self, client: str, limit: int) -> float:
        """Seconds until the client's last minute holds fewer than `limit` tokens (0: it does now)."""
        total = self.recent(client)
        if total < limit:
            return 0.0
        for second, tokens in self._buckets.get(client, ()):
            total -= tokens
            if total < limit:  # once this bucket is a minute old
                return max(second + 1 + WINDOW_SECONDS - self._clock(), 0.0)
        return WINDOW_SECONDS  # unreachable: the buckets sum to `total`

    def _prune(self, client: str, buckets: deque[list[int]]) -> None:
        oldest = self._clock() - WINDOW_SECONDS
        while buckets and buckets[0][0] + 1 <= oldest:
            buckets.popleft()
        if not buckets:
            del self._buckets[client]
