"""One-pass requests on the engine: scoring, readouts and residual rows of a token list.

Engine (engine.py) owns request checks, routing and tagging and holds a Passes; these are the
requests that run a prompt through the model once and decode nothing of use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypedDict, Unpack

from salience.core.engine.fair_share import ANONYMOUS, check_client
from salience.core.engine.output_streams import guarded
from salience.core.engine.prompt_scores import PromptScores
from salience.core.engine.prompts import check_expansion
from salience.core.engine.requests import NO_PROBES, Probes, ScoredToken, covers
from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from salience.core.engine.checks import RequestChecks
    from salience.core.engine.inflight import InFlight
    from salience.core.engine.live import Hold
    from salience.core.engine.preparation import Preparation
    from salience.core.engine.prompts import PlacedImage
    from salience.core.engine.row_budget import RowBudget
    from salience.core.probes.calibration import Presenter, ReadoutView
    from salience.core.probes.live import ConceptView
    from salience.core.probes.readouts import ReadoutHub

__all__ = ["PassOptions", "Passes", "PrefillOptions", "Steps"]


class Steps(Protocol):
    """What a pass takes of its engine (engine.Engine): the steps every request goes through,
    and where it goes."""

    checks: RequestChecks
    inflight: InFlight
    readouts: ReadoutHub | None
    row_budget: RowBudget
    max_model_len: int
    preparation: Preparation  # the steps every request takes before vLLM sees it

    @property
    def llm(self) -> AsyncLLM: ...

    def presenter(self, view: ConceptView | None, readout_view: ReadoutView) -> Presenter | None: ...


class PassOptions(TypedDict, total=False):
    """What a score takes besides its tokens (Passes.score)."""

    top_logprobs: int
    probes: Probes
    request_id: str | None
    dp_rank: int | None
    client: str
    weight: float


class PrefillOptions(TypedDict, total=False):
    """What a prefill takes besides its tokens (Passes.prefill)."""

    top_logprobs: int | None
    logprobs_from: int
    probes: Probes
    images: Sequence[PlacedImage]
    request_id: str | None
    dp_rank: int | None
    hold: Hold | None
    client: str
    weight: float


class Passes:
    """The one-pass requests of an engine: scores and reads `tokens` through the steps every
    request takes (preparation.py), then drops the one token vLLM decodes."""

    def __init__(self, engine: Steps) -> None:
        self._engine = engine

    async def score(
        self, prompt: Sequence[int], continuation: Sequence[int], **options: Unpack[PassOptions]
    ) -> list[ScoredToken]:
        """Logprob of each continuation token given the prompt and the tokens before it,
        with what the probes read where they cover its position (score_pass)."""
        scores = await self.score_pass(prompt, continuation, **options)
        if scores is None:
            return []
        return [scores.at(position) for position in range(scores.scored_from, len(scores.tokens))]

    async def score_pass(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        *,
        top_logprobs: int = 0,
        probes: Probes = NO_PROBES,
        request_id: str | None = None,
        dp_rank: int | None = None,
        client: str = ANONYMOUS,
        weight: float = 1.0,
    ) -> PromptScores | None:
        """One pass over prompt + continuation: the continuation's logprobs (from
        `PromptScores.scored_from`, the prompt's length, on) and what `probes` read on both, or
        None when there is nothing to compute (no continuation, nothing read). The steering's
        `generated` positions are the continuation's, as if the model had generated it.
        `client`, `weight`: as for prefill."""
        engine = self._engine
        prompt, continuation = engine.checks.scoring(prompt, continuation)
        if not continuation and not (probes.readout_ranges or probes.residual or probes.features):
            return None
        steering = engine.preparation.resolve_steer(probes.steer, len(prompt))
        return await self.prefill(
            prompt + continuation,
            top_logprobs=top_logprobs,
            logprobs_from=len(prompt),
            probes=dataclasses.replace(probes, steer=steering.interventions),
            request_id=request_id,
            dp_rank=dp_rank,
            client=client,
            weight=weight,
        )

    async def readout(self, tokens: Sequence[int], ranges: Sequence[tuple[int, int]]) -> dict[int, tuple[float, ...]]:
        """Readouts of `tokens` at the positions `ranges` cover, computing nothing else."""
        return (await self.prefill(tokens, probes=Probes(readout_ranges=ranges))).readouts

    async def prefill(
        self,
        tokens: Sequence[int],
        *,
        top_logprobs: int | None = None,
        logprobs_from: int = 1,
        probes: Probes = NO_PROBES,
        images: Sequence[PlacedImage] = (),
        request_id: str | None = None,
        dp_rank: int | None = None,
        hold: Hold | None = None,
        client: str = ANONYMOUS,
        weight: float = 1.0,
    ) -> PromptScores:
        """Run `tokens` through the model once: the logprob of every position from `logprobs_from`
        on (with `top_logprobs` alternatives; None computes none) and what `probes` read: readouts
        where their ranges cover (shown in their view), residual rows ([its layers, hidden] float32
        arrays by position) and an SAE's top features, under their steering (all of `tokens` are
        its prompt positions); they monitor nothing, as nothing is generated.
        `request_id` is vLLM's id for the pass (default: a new uuid4 hex). `hold`: run under a
        running request's concepts and steering (its last token's pass) instead of its own.
        `client`, `weight`: whose pass it is, as for Engine.generate; a last token's pass runs
        in its generation's turn."""
        check_client(client, weight)
        engine = self._engine
        ids = engine.checks.tokens("tokens", tokens)
        if not ids:
            raise InvalidArgument("tokens is empty: nothing to run through the model", field="tokens")
        if top_logprobs is not None:
            engine.checks.top_k(top_logprobs)
        # vLLM always decodes at least one token after the prompt.
        engine.checks.room(len(ids), 1, "one decode step")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=top_logprobs,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        plans = engine.preparation.row_plans(probes.residual, probes.features, len(ids))
        own = hold is None
        hold = engine.preparation.hold(probes.steer, len(ids), probes.patch) if hold is None else hold
        try:
            present = engine.presenter(hold.view, probes.readout_view)
            scored_from = None if top_logprobs is None else logprobs_from
            key, checked, submitted = engine.preparation.prepare(
                params, request_id, probes.readout_ranges, ids, images, hold, dp_rank, plans, scored_from
            )
        except BaseException:
            if own:
                hold.release()
            raise
        rank = engine.inflight.rank_of(key)
        if checked:
            assert engine.readouts is not None and hold.view is not None
            engine.readouts.register(key, len(hold.view.concepts))
        for plan in plans:
            engine.readouts.register(plan.key(key), plan.width, raw_layers=plan.layers)
        # A generation's last-token pass runs within the rows and the turn its generation holds.
        ticket = engine.row_budget.reserve(sum(plan.held for plan in plans) if own else 0)
        slot = engine.preparation.enter(client, weight, params, len(ids)) if own else None
        try:
            await ticket.ready()  # its own ticket and slot: released only below
            if slot is not None:
                await slot.ready()
            outputs = [
                out async for out in guarded(engine.llm.generate(submitted, params, key, data_parallel_rank=rank))
            ]
            check_expansion(outputs[-1], ids)
            if slot is not None:
                slot.cached(outputs[-1].num_cached_tokens or 0)
            readouts, rows = {}, {}
            if checked:
                readouts = await engine.readouts.take(key, [p for p in range(len(ids)) if covers(checked, p)])
                if present is not None:
                    readouts = {p: present(p, readouts[p]) for p in sorted(readouts)}
            for plan in plans:
                rows[plan.field] = await plan.take(engine.readouts, key, range(len(ids)))
        finally:
            ticket.release()
            if slot is not None:
                slot.release()
            engine.inflight.release(key)
            if checked:
                engine.readouts.release(key)
            for plan in plans:
                engine.readouts.release(plan.key(key))
            if own:
                hold.release()
        # FINAL_ONLY: exactly one output
        last = outputs[-1]
        return PromptScores(
            ids, last.prompt_logprobs, top_logprobs or 0, readouts, rows, logprobs_from, last.num_cached_tokens or 0
        )

    async def read_one(
        self,
        tokens: list[int],
        position: int,
        *,
        probes: Probes,
        images: Sequence[PlacedImage],
        hold: Hold,
        request_id: str,
        dp_rank: int | None = None,
    ) -> PromptScores | None:
        """The last token's pass: what its generation's `probes` read, at `position`, or None
        without room."""
        if len(tokens) >= self._engine.max_model_len:  # no room for the pass's one decode step
            return None
        # The generation's interventions in absolute form: the same positions steered, the same cache salt.
        return await self.prefill(
            tokens, probes=probes.at(position), images=images, hold=hold, request_id=request_id, dp_rank=dp_rank
        )
