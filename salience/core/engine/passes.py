"""One-pass requests on the engine: scoring, readouts and residual rows of a token list.

A mixin of Engine (engine.py), which owns request checks, routing and tagging; these are the
requests that run a prompt through the model once and decode nothing of use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from salience.core.engine.generation import PromptScores, guarded, residual_key
from salience.core.engine.prompts import check_expansion
from salience.core.engine.requests import ResidualRequest, ScoredToken, covers
from salience.core.probes.readouts import check_ranges
from salience.core.probes.steering import merge_ranges
from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.core.engine.live import Hold
    from salience.core.engine.prompts import PlacedImage
    from salience.core.probes.steering import Intervention

__all__ = ["MAX_RESIDUAL_ROWS", "Capture", "Passes"]

# Residual rows one request may ask for (positions x layers): 16K rows of a 1,536-wide model are
# 100 MB of float32 held until the request ends.
MAX_RESIDUAL_ROWS = 16384


class Passes:
    async def score(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        *,
        top_logprobs: int = 0,
        readout_ranges: Sequence[tuple[int, int]] = (),
        request_id: str | None = None,
        steer: Sequence[Intervention] = (),
        dp_rank: int | None = None,
        probabilities: bool = False,
        residual: ResidualRequest | None = None,
    ) -> list[ScoredToken]:
        """Logprob of each continuation token given the prompt and the tokens before it,
        with its readout where `readout_ranges` cover its position. `steer`'s `generated`
        positions are the continuation's, as if the model had generated it."""
        prompt, continuation = self.checks.scoring(prompt, continuation)
        if not continuation:
            return []
        ids = prompt + continuation
        steering = self.resolve_steer(steer, len(prompt))
        scores = await self.prefill(
            ids,
            top_logprobs=top_logprobs,
            readout_ranges=readout_ranges,
            request_id=request_id,
            steer=steering.interventions,
            dp_rank=dp_rank,
            probabilities=probabilities,
            residual=residual,
        )
        return [scores.at(position) for position in range(len(prompt), len(scores.tokens))]

    async def readout(self, tokens: Sequence[int], ranges: Sequence[tuple[int, int]]) -> dict[int, tuple[float, ...]]:
        """Readouts of `tokens` at the positions `ranges` cover, computing nothing else."""
        return (await self.prefill(tokens, readout_ranges=ranges)).readouts

    async def prefill(
        self,
        tokens: Sequence[int],
        *,
        top_logprobs: int | None = None,
        readout_ranges: Sequence[tuple[int, int]] = (),
        images: Sequence[PlacedImage] = (),
        request_id: str | None = None,
        steer: Sequence[Intervention] = (),
        dp_rank: int | None = None,
        probabilities: bool = False,
        residual: ResidualRequest | None = None,
        hold: Hold | None = None,
    ) -> PromptScores:
        """Run `tokens` through the model once: every position's logprob (with
        `top_logprobs` alternatives; None computes none) and the readouts `readout_ranges` cover
        (calibrated with `probabilities`), under `steer` (all of `tokens` are its prompt positions).
        `residual`: raw residual rows too, [its layers, hidden] float32 arrays by position.
        `request_id` is vLLM's id for the pass (default: a new uuid4 hex). `hold`: run under a
        running request's concepts and steering (its last token's pass) instead of its own."""
        ids = self.checks.tokens("tokens", tokens)
        if not ids:
            raise InvalidArgument("tokens is empty: nothing to run through the model")
        if top_logprobs is not None:
            self.checks.top_k(top_logprobs)
        # vLLM always decodes at least one token after the prompt.
        self.checks.room(len(ids), 1, "one decode step")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=top_logprobs,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        capture = self.residual_plan(residual, len(ids))
        own = hold is None
        hold = self._hold(steer, len(ids)) if hold is None else hold
        try:
            present = self.calibration(hold.view).probabilities if probabilities else None
            key, checked, submitted = self._prepare(
                params, request_id, readout_ranges, ids, images, hold, dp_rank, capture
            )
        except BaseException:
            if own:
                hold.release()
            raise
        rank = self.inflight.rank_of(key)
        if checked:
            assert self.readouts is not None and hold.view is not None
            self.readouts.register(key, len(hold.view.concepts))
        if capture is not None:
            self.readouts.register(residual_key(key), self.hidden_size, raw_layers=len(capture.slots))
        try:
            outputs = [
                out async for out in guarded(self._llm.generate(submitted, params, key, data_parallel_rank=rank))
            ]
            check_expansion(outputs[-1], ids)
            readouts = residuals = {}
            if checked:
                readouts = await self.readouts.take(key, [p for p in range(len(ids)) if covers(checked, p)])
                if present is not None:
                    readouts = {p: present(row) for p, row in readouts.items()}
            if capture is not None:
                wanted = [p for p in range(len(ids)) if covers(capture.ranges, p)]
                residuals = await self.readouts.take(residual_key(key), wanted)
        finally:
            self.inflight.release(key)
            if checked:
                self.readouts.release(key)
            if capture is not None:
                self.readouts.release(residual_key(key))
            if own:
                hold.release()
        # FINAL_ONLY: exactly one output
        return PromptScores(ids, outputs[-1].prompt_logprobs, top_logprobs or 0, readouts, residuals)

    async def _read_one(
        self,
        tokens: list[int],
        position: int,
        images: Sequence[PlacedImage],
        hold: Hold,
        request_id: str,
        dp_rank: int | None = None,
        readout: bool = True,
        residual_layers: tuple[int, ...] = (),
    ) -> PromptScores | None:
        """The last token's pass: its readout and residual rows (as asked), or None without room."""
        if len(tokens) >= self.max_model_len:  # no room for the pass's one decode step
            return None
        ranges = ((position, position + 1),)
        residual = ResidualRequest(layers=residual_layers, ranges=ranges) if residual_layers else None
        # The generation's interventions in absolute form: the same positions steered, the same cache salt.
        return await self.prefill(
            tokens,
            readout_ranges=ranges if readout else (),
            residual=residual,
            images=images,
            hold=hold,
            request_id=request_id,
            dp_rank=dp_rank,
        )

    def residual_plan(self, residual: ResidualRequest | None, end: int) -> Capture | None:
        """A request's residual rows checked against the served layers, with `end` the first
        position it cannot reach; None when none are asked for."""
        if residual is None:
            return None
        if self.readouts is None or self.settings.pipeline_parallel_size > 1:
            raise InvalidArgument("residual rows need concept readouts (a concept set) on one pipeline stage")
        read = self.readouts.table.loaded.layers
        layers = residual.layers
        if not layers or len(set(layers)) != len(layers):
            raise InvalidArgument("residual.layers must name one or more distinct layers")
        unknown = [layer for layer in layers if layer not in read]
        if unknown:
            raise InvalidArgument(
                f"residual layer {unknown[0]!r} is not read; residual rows come from the read layers "
                f"{read[0]}..{read[-1]} ({len(read)} of them)"
            )
        ranges = check_ranges(residual.ranges)
        if not ranges:
            raise InvalidArgument("residual.ranges names no positions")
        positions = sum(max(0, min(e, end) - s) for s, e in merge_ranges([(s, e) for s, e in ranges]))
        if positions * len(layers) > MAX_RESIDUAL_ROWS:
            raise InvalidArgument(
                f"residual asks for {positions} positions x {len(layers)} layers; at most {MAX_RESIDUAL_ROWS} "
                "rows per request (ask in several requests, or use fewer layers)"
            )
        return Capture(ranges, [read.index(layer) for layer in layers])


@dataclass(frozen=True)
class Capture:
    """A request's residual rows as the worker takes them: absolute ranges and readout slots."""

    ranges: list[list[int]]
    slots: list[int]
