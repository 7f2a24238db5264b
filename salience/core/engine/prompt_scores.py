"""What a pass over a token list computed (logprob entries, readouts, rows by position), and
the ranked alternatives of one vLLM logprob entry: shared by generations, scoring passes and
sessions."""

from __future__ import annotations

import dataclasses
from typing import Any

from salience.core.engine.requests import ScoredToken

__all__ = ["PromptScores", "top_alternatives"]


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """What a pass over a token list computed: vLLM's per-position logprob entries
    (None where none were asked for), readouts by position, and per field of ScoredToken
    ("residual", "features") the rows asked for by position (rows.py)."""

    tokens: list[int]
    entries: list | None
    top_k: int
    readouts: dict[int, tuple[float, ...]]
    rows: dict[str, dict[int, Any]] = dataclasses.field(default_factory=dict)
    # Positions before it carry no logprob: the pass may have read them from the prefix cache.
    scored_from: int = 1
    cached_tokens: int = 0  # prompt positions vLLM served from its prefix cache

    @property
    def residuals(self) -> dict[int, Any]:
        """Position -> [layers asked, hidden] float32."""
        return self.rows.get("residual", {})

    def at(self, position: int) -> ScoredToken:
        """Position's token scored given the tokens before it; position 0 has no logprob."""
        token = self.tokens[position]
        entry = self.entries[position] if self.entries is not None and position >= self.scored_from else None
        return ScoredToken(
            token_id=token,
            position=position,
            logprob=entry[token].logprob if entry else None,
            top_logprobs=top_alternatives(entry, self.top_k) if entry else (),
            readout=self.readouts.get(position),
            **{field: rows.get(position) for field, rows in self.rows.items()},
        )


def top_alternatives(entry, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens of a vLLM logprob dict, most likely first."""
    if k == 0:
        return ()
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return tuple((token, logprob) for _, token, logprob in ranked)
