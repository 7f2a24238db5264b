"""A session's turn: what a client asks of one call, and the run that streams it.

The store (sessions.py) validates a turn and commits its append; a TurnRun then runs it on the
engine and hands out SessionTokens: covered prefill positions first, in position order, then
decoded tokens, each joining the session's token list as it goes out, so a cancelled turn keeps
what the client already saw.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from salience.core.engine.fair_share import ANONYMOUS
from salience.core.engine.generation import Generation
from salience.core.engine.prompt_scores import PromptScores
from salience.core.engine.requests import (
    NO_PROBES,
    Features,
    FinishReason,
    ImageBlock,
    Probes,
    SamplingOptions,
    covers,
)
from salience.core.probes.monitors import MonitorEvent

__all__ = ["Range", "SessionToken", "Turn", "TurnDone", "TurnRun"]

Range = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One Generate call on a session. Ranges are absolute positions, [start, end)."""

    offset: int
    truncating: bool = False
    append: Sequence[int] = ()
    images: Sequence[ImageBlock] = ()
    logprob_ranges: Sequence[Range] = ()
    logprob_top_k: int = 0
    sampling: SamplingOptions = field(default_factory=lambda: SamplingOptions(max_tokens=0))
    request_id: str | None = None  # vLLM's id for the turn (default: a new uuid4 hex)
    # What the call reads and steers (absolute positions); its steering's `prompt` is the session's
    # tokens after the append, `generated` what it decodes.
    probes: Probes = NO_PROBES
    client: str = ANONYMOUS  # whose turn it is, and that client's share weight (engine/fair_share.py)
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SessionToken:
    """A token a turn reports: a covered prefill position, or a decoded token.

    `logprob` is None where no logprob range covers the position (and at position 0,
    which has no context); `readout` is None where no readout range covers it.
    """

    token_id: int
    position: int
    is_prefill: bool
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...]
    readout: tuple[float, ...] | None
    monitors: tuple[MonitorEvent, ...] = ()  # the turn's monitors that fired at this (decoded) token
    residual: Any = None  # float32 [layers asked, hidden] where the turn's residual ranges cover it
    features: Features | None = None  # (id, activation) pairs where the turn's feature ranges cover it


@dataclass(frozen=True, kw_only=True)
class TurnDone:
    prompt_tokens: int  # the session's length when decoding began
    completion_tokens: int
    finish_reason: FinishReason
    cached_tokens: int  # prompt tokens vLLM served from its prefix cache
    stopped_by: MonitorEvent | None = None  # with finish_reason MONITOR: the monitor that ended the turn

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TurnRun:
    """A started turn: iterate for SessionTokens; then `done` says how it ended.

    Covered prefill positions come first, in position order, then decoded tokens.
    Closing the iteration early (a cancelled call) aborts the engine request; the
    tokens already handed out stay in the session.
    """

    def __init__(
        self,
        tokens: array,
        on_end: Callable[[], None],
        work: Generation | None,
        scoring: Callable[[], Awaitable[PromptScores]] | None,
        prefill_wanted: list[int],
        logprob_ranges: list[Range],
    ) -> None:
        self.done: TurnDone | None = None
        self._tokens = tokens  # the session's: decoded tokens join it as they are handed out
        self._on_end = on_end
        self._work = work
        self._scoring = scoring
        self._prefill_wanted = prefill_wanted
        self._logprob_ranges = logprob_ranges
        self._stopped = False

    async def cancel(self) -> None:
        """Abort from outside (a client's cancel, the session closed): iteration ends as CANCELLED."""
        self._stopped = True
        if self._work is not None:
            await self._work.cancel()

    async def __aiter__(self) -> AsyncIterator[SessionToken]:
        prompt_tokens, completion = len(self._tokens), 0
        reason = FinishReason.LENGTH
        stopped_by = None
        cached = 0
        try:
            if self._scoring is not None:
                # One pass: skipped if cancelled before it, its results dropped if cancelled during it.
                scores = None if self._stopped else await self._scoring()
                if scores is not None:
                    cached = scores.cached_tokens
                if scores is not None and not self._stopped:
                    for token in self._prefill_tokens(scores):
                        yield token
            elif self._work is not None:  # a Generation cancelled before it starts never reaches vLLM
                async with self._work as generation:
                    async for event in generation:
                        if completion == 0:
                            for token in self._prefill_tokens(generation.prompt_scores()):
                                yield token
                        self._tokens.append(event.token_id)
                        completion += 1
                        covered = covers(self._logprob_ranges, event.position)
                        yield SessionToken(
                            token_id=event.token_id,
                            position=event.position,
                            is_prefill=False,
                            logprob=event.logprob if covered else None,
                            top_logprobs=event.top_logprobs if covered else (),
                            readout=event.readout,
                            monitors=event.monitors,
                            residual=event.residual,
                            features=event.features,
                        )
                        stopped_by = event.stopped_by or stopped_by
                reason = generation.finish_reason or FinishReason.CANCELLED
            if self._stopped:
                reason = FinishReason.CANCELLED
            if self._work is not None:
                cached = self._work.cached_tokens or 0
            self.done = TurnDone(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion,
                finish_reason=reason,
                cached_tokens=cached,
                stopped_by=stopped_by if reason is FinishReason.MONITOR else None,
            )
        finally:
            self._on_end()

    def _prefill_tokens(self, scores: PromptScores) -> list[SessionToken]:
        tokens = []
        for position in self._prefill_wanted:
            scored = scores.at(position)
            covered = covers(self._logprob_ranges, position)
            tokens.append(
                SessionToken(
                    token_id=scored.token_id,
                    position=position,
                    is_prefill=True,
                    logprob=scored.logprob if covered else None,
                    top_logprobs=scored.top_logprobs if covered else (),
                    readout=scored.readout,
                    residual=scored.residual,
                    features=scored.features,
                )
            )
        return tokens
