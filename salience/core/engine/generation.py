"""A request in flight: vLLM's outputs as TokenEvents.

Split from engine.py, which validates and submits; this module follows one
request's outputs, holding each event back one step while its readout is
captured (see readouts.py). Its output stream is wrapped in output_streams.py
(vLLM's failures as Salience's errors); what a pass over a prompt computed is
prompt_scores.py's.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from salience.core.engine.output_streams import admitted, guarded, releasing
from salience.core.engine.prompt_scores import PromptScores, top_alternatives
from salience.core.engine.prompts import check_expansion
from salience.core.engine.requests import Features, FinishReason, TokenEvent, covers
from salience.core.probes.calibration import Presenter
from salience.core.probes.monitors import MonitorState
from salience.errors import EngineError

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

    from salience.core.engine.fair_share import Slot
    from salience.core.engine.row_budget import Ticket
    from salience.core.engine.rows import RowPlan
    from salience.core.probes.readouts import ReadoutHub

__all__ = ["Generation"]

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}


def _as_read(position: int, row: tuple[float, ...]) -> tuple[float, ...]:
    return row


class Generation:
    """A running request: an async iterator of TokenEvents.

    After iteration ends, `finish_reason` says why; a generation cancelled after
    its last token was delivered ends without a further event. `cached_tokens`
    is how many prompt tokens vLLM served from its prefix cache.

    With readouts, each event is held back one engine step, until the token has
    been fed through the model and its readout captured (see readouts.py). The
    last token is never fed back, so when it is covered one more pass reads it
    out (prompt + completion: the prefix cache leaves one position to compute).
    `prompt_readouts` holds the prompt positions' readouts, and `prompt_scores()`
    the prompt's logprobs as well, once the first event is out.

    Monitors read every generated token's readout (`ranges` then covers them all, `shown` only
    those the client asked to see). A monitor's `stop` ends the generation at the token where it
    holds: that event is the last, with finish_reason MONITOR, and the request is aborted in vLLM.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        prompt: list[int],
        submitted: object,
        params: SamplingParams,
        request_id: str,
        priority: int,
        hub: ReadoutHub | None = None,
        ranges: list[list[int]] | None = None,
        read_last: Callable[[list[int], int], Awaitable[PromptScores | None]] | None = None,
        *,
        dp_rank: int | None = None,
        shown: list[list[int]] | None = None,
        monitors: MonitorState | None = None,
        readout_concepts: int = 0,
        present: Presenter | None = None,
        rows: Sequence[RowPlan] = (),
        shown_features: tuple[int, list[list[int]]] | None = None,
        ticket: Ticket | None = None,
        slot: Slot | None = None,
        logprobs_from: int = 1,
        meter: Callable[[int], None] | None = None,
    ):
        """`rows`: the residual rows and features asked for (rows.py), with `ticket` their claim on
        the server's residual budget; `slot`: its place under fair share, charged the tokens vLLM
        computes for it. The request reaches vLLM once both are granted.
        `shown_features`: with feature monitors, which features the client sees (its k and
        ranges) of those read."""
        self.request_id = request_id
        self.dp_rank = dp_rank  # the data-parallel engine it runs on (None: no data parallelism)
        self.on_end: Callable[[], None] | None = None  # called once, when the request is over
        self.concepts = None  # the live.ConceptView its readouts follow (Engine.generate sets it)
        self.prompt_tokens = len(prompt)
        self.cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.prompt_readouts: dict[int, tuple[float, ...]] = {}
        self.prompt_rows: dict[str, dict[int, Any]] = {plan.field: {} for plan in rows}  # as PromptScores.rows
        self._llm = llm
        self._tokens = list(prompt)  # prompt + completion so far
        self._prompt_entries: list | None = None
        self._prompt_top_k = params.prompt_logprobs or 0
        self._logprobs_from = logprobs_from
        self._read_last = read_last
        self._top_k = params.logprobs or 0
        self._next_position = len(prompt)
        self._pending: deque[TokenEvent] = deque()
        self._held: list[TokenEvent] = []
        self._hub = hub if ranges or rows else None
        self._ranges = ranges or []
        self._rows = list(rows)
        self._shown_features = shown_features
        self._shown = self._ranges if shown is None else shown
        self._monitors = monitors if monitors else None
        self._present = present  # how shown rows go out (calibrated probabilities); None: as read
        # The last token's residual exists once it is fed back. With room in the context, decode
        # one token more than asked and drop it: one more row in a batched decode step instead
        # of a separate pass over the whole sequence after the end (which stays the fallback).
        self._limit = params.max_tokens
        last = len(prompt) + params.max_tokens - 1
        self._lookahead = self._hub is not None and self._covered(last) and last + 1 < llm.model_config.max_model_len
        if self._lookahead:
            params.max_tokens += 1
        self._looked_ahead = False  # the extra token came: every delivered token has been fed
        self._submitted = False  # vLLM's generator starts (and adds the request) on the first __anext__
        self._cancelled = False
        self._engine_finished = False  # vLLM sent the last output; its generator has yet to return
        outputs = guarded(llm.generate(submitted, params, request_id, priority=priority, data_parallel_rank=dp_rank))
        self._slot = slot
        self._meter = meter  # counts the tokens it decodes against its client's per-minute limit
        self._gates = [gate for gate in (ticket, slot) if gate is not None]
        for gate in (slot, ticket):  # queued: vLLM sees it once rows come back, then once it is its turn
            if gate is not None and not gate.granted:
                outputs = admitted(gate, outputs)
        if self._hub is not None:
            keys = []
            if self._ranges:
                self._hub.register(request_id, readout_concepts)
                keys.append(request_id)
            for plan in self._rows:
                self._hub.register(plan.key(request_id), plan.width, raw_layers=plan.layers)
                keys.append(plan.key(request_id))
            self._keys = keys
            outputs = releasing(outputs, self._hub, keys)
        self._outputs = outputs

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._pending:
            if self.finish_reason is not None:
                if self._engine_finished:
                    # Let vLLM's generator return: closed before, it would abort the finished
                    # request (one more message to the engine, and "aborted" in vLLM's log lines).
                    self._engine_finished = False
                    await anext(self._outputs, None)
                self._ended()
                raise StopAsyncIteration
            try:
                self._submitted = True
                out = await anext(self._outputs)
            except StopAsyncIteration:
                self.finish_reason = self.finish_reason or FinishReason.CANCELLED
                self._pending.extend(self._held)
                self._held = []
                continue
            if self._cancelled and not out.finished:
                # cancel() came while vLLM was still adding the request, before the id it aborts by
                # was known, so the abort missed it: closing vLLM's generator aborts it now.
                await self._outputs.aclose()
                self.finish_reason = FinishReason.CANCELLED
                continue
            first = self.cached_tokens is None
            events = self._absorb(out)
            if self._hub is None:
                self._pending.extend(events)
            else:
                await self._with_readouts(events, first)
        return self._pending.popleft()

    @property
    def prompt_residuals(self) -> dict[int, Any]:
        return self.prompt_rows.get("residual", {})

    def _covered(self, position: int) -> bool:
        """Whether the position's readout or any of its rows were asked for."""
        if covers(self._ranges, position):
            return True
        return bool(self._rows) and any(covers(plan.ranges, position) for plan in self._rows)

    def prompt_scores(self) -> PromptScores:
        """The prompt positions' logprobs (if asked for), readouts and rows."""
        return PromptScores(
            self._tokens[: self.prompt_tokens],
            self._prompt_entries,
            self._prompt_top_k,
            self.prompt_readouts,
            self.prompt_rows,
            self._logprobs_from,
            self.cached_tokens or 0,
        )

    async def _take(self, positions: list[int]) -> tuple[dict, dict[str, dict]]:
        """The readouts and the rows captured at `positions`, each where it was asked for; rows per
        field, as handed out."""
        assert self._hub is not None
        readouts = [p for p in positions if covers(self._ranges, p)]
        got = await self._hub.take(self.request_id, readouts) if readouts else {}
        rows = {plan.field: await plan.take(self._hub, self.request_id, positions) for plan in self._rows}
        return got, rows

    async def _with_readouts(self, events: list[TokenEvent], first: bool) -> None:
        assert self._hub is not None
        candidates = self._held + events
        finished = self.finish_reason is not None
        self._held = [] if finished or not candidates else candidates[-1:]
        ready = candidates if finished else candidates[:-1]
        # Every token but the newest has been fed through the model by now; all of them once
        # the extra token decoded after the last has come.
        fed = candidates if self._looked_ahead else candidates[:-1]
        wanted = [e.position for e in fed if self._covered(e.position)]
        prompt = [p for p in range(self.prompt_tokens) if self._covered(p)] if first else []
        got, rows = await self._take(prompt + wanted)
        present = self._present or _as_read
        if prompt:
            self._file_prompt(prompt, got, rows, present)
        if finished and ready and self._read_last is not None and self.finish_reason is not FinishReason.CANCELLED:
            last = ready[-1].position
            if self._covered(last) and last not in got and not any(last in taken for taken in rows.values()):
                scores = await self._read_last(self._tokens[: last + 1], last)
                if scores is not None:
                    got.update(scores.readouts)
                    for field, taken in scores.rows.items():
                        rows[field].update(taken)
        if finished and ready and self._looked_ahead:  # the output that finished held only the dropped token
            ready[-1] = dataclasses.replace(ready[-1], finish_reason=self.finish_reason)
        watched = rows.get("features", {})
        for event in ready:
            row = got.get(event.position)
            fired = ()
            if self._monitors and (row is not None or not self._monitors.concepts):
                fired = self._monitors.step(event.position, row, watched.get(event.position), event.token_id)
            shown = present(event.position, row) if row is not None and covers(self._shown, event.position) else None
            found = {field: taken[event.position] for field, taken in rows.items() if event.position in taken}
            if "features" in found:
                found["features"] = self._client_features(event.position, found["features"])
                if found["features"] is None:
                    del found["features"]
            if shown is not None or fired or found:
                event = dataclasses.replace(event, readout=shown, monitors=fired, **found)
            if event.stopped_by is not None:
                self._pending.append(dataclasses.replace(event, finish_reason=FinishReason.MONITOR))
                await self._stop_by_monitor()
                return
            self._pending.append(event)

    def _file_prompt(self, prompt: list[int], got: dict, rows: dict[str, dict], present: Callable) -> None:
        """The prompt positions' readouts and rows, taken with the first output."""
        self.prompt_readouts.update((p, present(p, got[p])) for p in prompt if p in got)
        for field, taken in rows.items():
            self.prompt_rows[field].update((p, taken[p]) for p in prompt if p in taken)
        mine = self.prompt_rows.get("features", {})
        for position in [p for p in prompt if p in mine]:
            if (features := self._client_features(position, mine[position])) is None:
                del mine[position]
            else:
                mine[position] = features

    def _client_features(self, position: int, features: Features) -> Features | None:
        """With feature monitors, what the client asked to see of a position's features (None: nothing)."""
        if self._shown_features is None:
            return features
        k, ranges = self._shown_features
        return features[:k] if covers(ranges, position) else None

    async def _stop_by_monitor(self) -> None:
        """End here: drop what came after the stopping token; closing vLLM's generator aborts the
        request if it is still running (and frees its readout state)."""
        self.finish_reason = FinishReason.MONITOR
        self._held = []
        self._engine_finished = False
        await self._outputs.aclose()

    async def cancel(self) -> None:
        """Abort in the engine; iteration then ends with finish_reason CANCELLED. Cancelled
        before its first __anext__, the request never reaches vLLM."""
        if self.finish_reason is not None:
            return
        self._cancelled = True
        queued = [gate for gate in self._gates if not gate.granted]
        for gate in queued:  # waiting for residual rows or its turn: it never reaches vLLM, and iteration ends
            gate.release()
        if not self._submitted:
            self.finish_reason = FinishReason.CANCELLED
            if self._hub is not None:
                for key in self._keys:  # registered for them; releasing() never started
                    self._hub.release(key)
            return
        if not queued:
            await self._llm.abort(self.request_id)

    async def aclose(self) -> None:
        """Stop consuming; aborts the request if it is still running."""
        try:
            await self._outputs.aclose()
        finally:
            self._ended()

    def _ended(self) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _absorb(self, out: RequestOutput) -> list[TokenEvent]:
        completion = out.outputs[0]
        if self.cached_tokens is None:
            self.cached_tokens = out.num_cached_tokens or 0
            self._prompt_entries = out.prompt_logprobs
            check_expansion(out, self._tokens[: self.prompt_tokens])
            if self._slot is not None:
                self._slot.cached(self.cached_tokens)
        if self._slot is not None:
            self._slot.generated(len(completion.token_ids))
        if self._meter is not None:
            self._meter(len(completion.token_ids))
        logprobs = completion.logprobs
        events = []
        tokens = list(completion.token_ids)
        room = self._limit - (self._next_position - self.prompt_tokens)
        if len(tokens) > room:  # the lookahead token: never delivered
            tokens = tokens[:room]
            self._looked_ahead = True
        for i, token in enumerate(tokens):
            entry = logprobs[i]
            events.append(
                TokenEvent(
                    token_id=token,
                    position=self._next_position,
                    logprob=entry[token].logprob,
                    top_logprobs=top_alternatives(entry, self._top_k),
                )
            )
            self._next_position += 1
        self._tokens += tokens
        if out.finished:
            self._engine_finished = True
            reason = completion.finish_reason
            if reason not in _FINISH:
                raise EngineError(f"the engine ended the request with {reason!r}")
            # After the lookahead token the asked-for length was reached, whatever ended the extra one.
            self.finish_reason = FinishReason.LENGTH if self._looked_ahead else _FINISH[reason]
            if events:
                events[-1] = dataclasses.replace(events[-1], finish_reason=self.finish_reason)
        return events
