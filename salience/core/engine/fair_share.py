"""Fair share across clients: which request enters vLLM next when the engine is contended.

Theory of operation. vLLM decodes one token per running request per step, so on a contended
engine a client's share of the generated tokens is its share of the running requests. vLLM runs
up to `room` at once (its max_num_seqs) and would take them first come, first served: a client
with 64 streams gets 64 tokens a step against another's one, and past `room` a newcomer waits
behind everyone queued before it. So Salience admits each request here, before vLLM sees it:

- While fewer than `max_running` (N) run, a request enters at once: nothing is held back on a
  quiet engine, and one client alone may use all N (work-conserving).
- Past N, a client running fewer than its share of N (N x its weight / the active clients'
  weights) still enters at once, into the room between N and `room`: vLLM cannot preempt the
  requests already running, and a newcomer must not wait for them to end.
- Any other request waits in its client's line, in the order vLLM would take them: by the
  request's own priority (lower first), then first come, first served. When requests end, a
  waiting client below its share goes first, and among the others the one with the least
  service: the Virtual Token Counter (Sheng et al.,
  "Fairness in Serving Large Language Models", OSDI 2024). Each client's counter grows by its
  requests' generated tokens as they stream, plus PROMPT_WEIGHT per prompt token vLLM computes
  (charged as the request enters, refunded for those its prefix cache served), divided by the
  client's weight. A client becoming active is lifted to the lowest counter of the active ones,
  so time spent idle is not credit to spend later; an idle client above that floor keeps its
  counter (a deficit is not forgiven by pausing). Counters are forgotten when no client is
  active.

docs/security.md#fair-share states what this guarantees. One FairShare per engine; not
thread-safe: use it from the event loop.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.core.engine.settings import EngineSettings

__all__ = ["ANONYMOUS", "PROMPT_WEIGHT", "FairShare", "Slot", "admission", "check_client"]

ANONYMOUS = "anonymous"  # the client of a request that names none
PROMPT_WEIGHT = 0.5  # a computed prompt token costs half a generated one, VTC's w_p / w_q


def check_client(client: str, weight: float) -> None:
    """A client's name and share weight as a request states them, or InvalidArgument."""
    if not isinstance(client, str) or not client:
        raise InvalidArgument(f"client must be a non-empty string, got {client!r}", field="client")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise InvalidArgument(f"weight must be a positive number, got {weight!r}", field="weight")


@dataclass(eq=False)
class _Client:
    name: str
    weight: float
    served: float = 0.0  # the virtual token counter: weighted tokens / weight
    running: int = 0
    waiting: list[Slot] = field(default_factory=list)  # in the order they may enter (Slot.place)

    @property
    def active(self) -> bool:
        return self.running > 0 or bool(self.waiting)


class Slot:
    """One request's place in the engine: granted at once, or queued in its client's line."""

    def __init__(self, share: FairShare, client: _Client, prompt_tokens: int, priority: int, order: int) -> None:
        self.granted = False
        # Granted at once to a client with nothing running while others ran: its prompt may take a
        # step of its own (newcomer_scheduler.py).
        self.newcomer = False
        self._share = share
        self._client = client
        self._prompt_tokens = prompt_tokens
        self.place = (priority, order)  # in its client's line; `order` (arrival) also breaks ties between clients
        self._done = False
        self._wake: asyncio.Event | None = None

    async def ready(self) -> bool:
        """Wait for the turn: True, or False if released (the request cancelled) before it."""
        if not self.granted and not self._done:
            self._wake = self._wake or asyncio.Event()
            await self._wake.wait()
        return self.granted

    def generated(self, tokens: int) -> None:
        """Charge tokens vLLM decoded for the request."""
        self._client.served += tokens / self._client.weight

    def cached(self, tokens: int) -> None:
        """Refund prompt tokens vLLM served from its prefix cache: charged on entry, never computed."""
        self._client.served -= PROMPT_WEIGHT * min(tokens, self._prompt_tokens) / self._client.weight

    def release(self) -> None:
        """The request ended, or left the line. Safe to call twice."""
        if self._done:
            return
        self._done = True
        self._share._released(self)
        if self._wake is not None:
            self._wake.set()

    def _grant(self) -> None:
        self.granted = True
        self._client.served += PROMPT_WEIGHT * self._prompt_tokens / self._client.weight
        if self._wake is not None:
            self._wake.set()


class FairShare:
    """The engine's admission: at most `max_running` requests at once, more up to `room` for
    clients below their share, the rest in per-client lines served least counter first."""

    def __init__(self, max_running: int, room: int) -> None:
        self.max_running = max_running
        self.room = room
        self.running = 0  # granted requests that have not ended
        self._clients: dict[str, _Client] = {}  # the active ones, and idle ones above their floor
        self._arrivals = itertools.count()

    def enter(self, client: str, weight: float, prompt_tokens: int, priority: int = 0) -> Slot:
        """A request of `client` (share weight `weight`) with `prompt_tokens` to prefill and vLLM's
        `priority`: its slot, granted now if it may enter, else queued in the client's line."""
        owner = self._activate(client, weight)
        slot = Slot(self, owner, prompt_tokens, priority, next(self._arrivals))
        idle, others = owner.running == 0, self.running > 0
        bisect.insort(owner.waiting, slot, key=lambda s: s.place)
        self._serve()
        slot.newcomer = slot.granted and idle and others
        return slot

    def waiting(self) -> int:
        """Requests queued in front of vLLM, every client's line together."""
        return sum(len(client.waiting) for client in self._clients.values())

    def counters(self) -> dict[str, float]:
        """Each known client's virtual token counter (service / weight) in this busy period."""
        return {name: client.served for name, client in self._clients.items()}

    def _activate(self, name: str, weight: float) -> _Client:
        client = self._clients.get(name)
        if client is None or not client.active:  # lifted to the active ones' floor (none: a new busy period)
            floor = min((c.served for c in self._clients.values() if c.active), default=0.0)
            client = client or self._clients.setdefault(name, _Client(name, weight))
            client.served = max(client.served, floor)
        client.weight = weight
        return client

    def _released(self, slot: Slot) -> None:
        client = slot._client
        if slot.granted:
            self.running -= 1
            client.running -= 1
        else:
            client.waiting.remove(slot)
        if not client.active:
            self._forget_idle()
        self._serve()

    def _forget_idle(self) -> None:
        """Drop idle clients a return would lift anyway (at or below the active ones' floor); all
        of them when none is active, which starts a new busy period."""
        floor = min((c.served for c in self._clients.values() if c.active), default=math.inf)
        for name in [n for n, c in self._clients.items() if not c.active and c.served <= floor]:
            del self._clients[name]

    def _serve(self) -> None:
        """Grant waiting requests while any may enter: clients below their share first, then the
        least served."""
        active = [c for c in self._clients.values() if c.active]
        total_weight = sum(c.weight for c in active)
        while True:
            free = self.running < self.max_running
            room = self.running < self.room
            below = {c for c in active if c.running + 1 <= self.max_running * c.weight / total_weight}
            eligible = [c for c in active if c.waiting and (free or (room and c in below))]
            if not eligible:
                return
            client = min(eligible, key=lambda c: (c not in below, c.served, c.waiting[0].place[1]))
            self.running += 1
            client.running += 1
            client.waiting.pop(0)._grant()


def admission(settings: EngineSettings, max_num_seqs: int) -> FairShare | None:
    """The engine's FairShare for its settings and vLLM's max_num_seqs (None: fair share off).
    Both counts are per replica: with data parallelism the engine admits for all of them."""
    if not settings.fair_share:
        return None
    max_running = settings.max_running or max(1, max_num_seqs * 3 // 4)
    if max_running > max_num_seqs:
        raise InvalidArgument(
            f"--max-running {max_running} is more than vLLM runs at once ({max_num_seqs}, its max_num_seqs): "
            f"lower it, or raise that with --engine-arg max_num_seqs={max_running + max_running // 3}"
        )
    replicas = settings.data_parallel_size
    return FairShare(max_running * replicas, max_num_seqs * replicas)
