"""The requests one engine has in vLLM, and which data-parallel rank each runs on.

vLLM aborts by request id and the readout hub keys by it, so no two requests in flight may
share one. With DP, new sessions and stateless requests go to the rank with the fewest
requests this server has in flight (vLLM's own balancing cannot know a session's rank).
"""

from __future__ import annotations

import uuid

from salience.core.engine.generation import Generation
from salience.errors import InvalidArgument

__all__ = ["InFlight"]


class InFlight:
    def __init__(self, data_parallel_size: int) -> None:
        self.data_parallel_size = data_parallel_size
        self.rank_load = [0] * data_parallel_size  # requests in flight per DP rank
        self._live: dict[str, Generation | None] = {}  # a running Generation, or None for a one-pass request
        self._rank_of: dict[str, int] = {}

    def claim(self, request_id: str | None) -> str:
        """`request_id` (or a new uuid4 hex) made unique among the requests in flight: an id
        already in flight gets `.2`, `.3`, ... appended."""
        base = request_id or uuid.uuid4().hex
        claimed, n = base, 1
        while claimed in self._live:
            n += 1
            claimed = f"{base}.{n}"
        self._live[claimed] = None
        return claimed

    def running(self, request_id: str, generation: Generation) -> None:
        self._live[request_id] = generation

    def generations(self) -> list[Generation]:
        return [g for g in self._live.values() if g is not None]

    def release(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self.rank_load[rank] -= 1

    def pick_rank(self) -> int | None:
        """The least loaded DP rank, None without DP: where a new session or a stateless request goes."""
        if self.data_parallel_size == 1:
            return None
        return min(range(self.data_parallel_size), key=self.rank_load.__getitem__)

    def route(self, request_id: str, rank: int | None) -> int | None:
        """The DP rank the request runs on: `rank` (a session's), or the least loaded."""
        if self.data_parallel_size == 1:
            return None
        if rank is None:
            rank = self.pick_rank()
        elif not 0 <= rank < self.data_parallel_size:
            raise InvalidArgument(f"data parallel rank {rank} is not in 0..{self.data_parallel_size - 1}")
        self._rank_of[request_id] = rank
        self.rank_load[rank] += 1
        return rank

    def rank_of(self, request_id: str) -> int | None:
        return self._rank_of.get(request_id)
