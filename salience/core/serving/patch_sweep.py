"""Causal tracing: activation patching swept over hook points, layers and positions, in one batch.

A sweep runs a clean and a corrupted prompt (the same length: a corruption replaces tokens), reads
the clean run's activations at every swept point and layer itself (residual rows at the patch
points: engine/rows.py), then runs one patched copy of the corrupted prompt per cell, each with the
clean run's activation at that point, layer and position put back (probes/patching.py). The cells
are submitted together, so the engine batches them as it batches any concurrent requests (within
the fair-share rules: they are one client's). Each cell's metric is read from the answer's
logprobs: `logprob`, the answer's (its tokens' summed), or `logit_diff`, the answer's minus the
foil's (for single tokens exactly their logits' difference; a second pass per cell). A one-token
answer is read from one decode step's raw logprobs, a longer one from a score of its tokens.

The grid is the metric per point, layer and position, with the clean and corrupted baselines; the
share of the clean run's metric a cell restores is (cell - corrupted) / (clean - corrupted), as
ROME's causal tracing plots it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from salience.core.engine.fair_share import ANONYMOUS
from salience.core.engine.requests import Probes, ResidualRequest, SamplingOptions
from salience.core.models.points import Point
from salience.core.probes.patching import Patch
from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.core.engine.engine import Engine

__all__ = ["MAX_CELLS", "METRICS", "Sweep", "SweepGrid", "sweep"]

Metric = Literal["logprob", "logit_diff"]
METRICS: tuple[Metric, ...] = ("logprob", "logit_diff")
MAX_CELLS = 8192  # patched runs one sweep may ask for
RUNNING = 64  # cells in flight at once: enough to fill the engine's batch, few enough to cancel fast


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """What to sweep: the prompts (token ids), the answer (and for `logit_diff` the foil) that
    follows them, and the points, layers and positions to patch (empty: every layer, every
    position of the prompt)."""

    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: tuple[int, ...]
    foil: tuple[int, ...] = ()
    points: tuple[Point, ...] = ("resid_pre",)
    layers: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    metric: Metric = "logprob"


@dataclass(frozen=True)
class SweepGrid:
    """The metric of every patched run: `values[point][i][j]` is layer `layers[i]` at position
    `positions[j]`; `clean` and `corrupted` are the unpatched runs'."""

    metric: Metric
    points: tuple[Point, ...]
    layers: tuple[int, ...]
    positions: tuple[int, ...]
    values: dict[Point, list[list[float]]] = field(default_factory=dict)
    clean: float = 0.0
    corrupted: float = 0.0

    def restored(self, point: Point) -> list[list[float]]:
        """Each cell's share of the clean run's metric restored: 0 is the corrupted run, 1 the clean."""
        span = self.clean - self.corrupted
        return [[(v - self.corrupted) / span if span else 0.0 for v in row] for row in self.values[point]]

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "points": list(self.points),
            "layers": list(self.layers),
            "positions": list(self.positions),
            "clean": self.clean,
            "corrupted": self.corrupted,
            "grid": {point: self.values[point] for point in self.points},
        }


async def sweep(
    engine: Engine,
    request: Sweep,
    *,
    progress: Callable[[int, int], None] | None = None,
    client: str = ANONYMOUS,
    weight: float = 1.0,
) -> SweepGrid:
    """Run `request` on `engine` (see the module docstring); `progress(done, total)` is called as
    cells finish. Cancelling the call cancels every cell still running."""
    layers, positions = _check(engine, request)
    options = {"client": client, "weight": weight}

    async def clean_rows_at(point: Point) -> dict:
        """The clean run's activations at `point`, every swept layer: {position: [layers, hidden]}."""
        asked = ResidualRequest(layers=layers, ranges=((0, len(request.clean)),), point=point)
        return (await engine.prefill(request.clean, probes=Probes(residual=asked), **options)).residuals

    clean_rows = dict(zip(request.points, await asyncio.gather(*map(clean_rows_at, request.points)), strict=True))

    async def metric(prompt: Sequence[int], patches: tuple[Patch, ...] = ()) -> float:
        value = await _answer_logprob(engine, prompt, request.answer, patches, options)
        if request.metric == "logit_diff":
            value -= await _answer_logprob(engine, prompt, request.foil, patches, options)
        return value

    clean, corrupted = await asyncio.gather(metric(request.clean), metric(request.corrupted))
    cells = list(itertools.product(request.points, range(len(layers)), range(len(positions))))
    grid = {point: [[0.0] * len(positions) for _ in layers] for point in request.points}
    done = 0
    gate = asyncio.Semaphore(RUNNING)

    import numpy as np

    async def cell(point: Point, i: int, j: int) -> None:
        """Layer layers[i] at position positions[j] put back."""
        nonlocal done
        row = np.ascontiguousarray(clean_rows[point][positions[j]][i], dtype=np.float32)
        patch = Patch(point=point, layer=layers[i], positions=(positions[j],), rows=row.tobytes())
        async with gate:
            grid[point][i][j] = await metric(request.corrupted, (patch,))
        done += 1
        if progress is not None:
            progress(done, len(cells))

    tasks = [asyncio.ensure_future(cell(*c)) for c in cells]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return SweepGrid(request.metric, request.points, layers, positions, grid, clean, corrupted)


async def _answer_logprob(
    engine: Engine, prompt: Sequence[int], answer: Sequence[int], patches: tuple[Patch, ...], options: dict
) -> float:
    """The answer's logprob after `prompt` (its tokens' summed), under `patches`. One token is
    the model's raw logprob of it as the next token, decoded with it the only one allowed: the
    logits of the last position only (a score computes every prompt position's: a fifth of a
    small model's work on a short prompt)."""
    probes = Probes(patch=patches)
    if len(answer) == 1:
        forced = SamplingOptions(
            max_tokens=1, temperature=0.0, allowed_token_ids=tuple(answer), raw_logprobs=True, ignore_eos=True
        )
        events = [event async for event in engine.generate(prompt, forced, probes=probes, **options)]
        return events[0].logprob
    ids = [*prompt, *answer]
    scores = await engine.prefill(ids, top_logprobs=0, logprobs_from=len(prompt), probes=probes, **options)
    return float(sum(scores.at(p).logprob for p in range(len(prompt), len(ids))))


def _check(engine: Engine, request: Sweep) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The swept layers and positions, checked against the engine; InvalidArgument naming the field."""
    if not request.clean or not request.corrupted:
        raise InvalidArgument("a sweep needs a clean and a corrupted prompt", field="clean")
    if len(request.clean) != len(request.corrupted):
        raise InvalidArgument(
            f"the clean prompt has {len(request.clean)} tokens and the corrupted {len(request.corrupted)}: "
            "a patch puts a position back, so they must be the same length",
            field="corrupted",
        )
    if not request.answer:
        raise InvalidArgument("a sweep needs answer tokens to measure", field="answer")
    if request.metric not in METRICS:
        raise InvalidArgument(f"metric must be one of {', '.join(METRICS)}, got {request.metric!r}", field="metric")
    if (request.metric == "logit_diff") != bool(request.foil):
        raise InvalidArgument(
            "logit_diff compares the answer with a foil: give foil tokens with it, only", field="foil"
        )
    patching = engine.patching
    if patching is None:
        raise InvalidArgument("sweeps patch, and this server patches nowhere (start it with --patch-points)")
    if not request.points or len(set(request.points)) != len(request.points):
        raise InvalidArgument("points must name one or more distinct hook points", field="points")
    for point in request.points:
        if point not in patching.points:
            raise InvalidArgument(
                f"this server patches no {point!r} (it patches {', '.join(patching.points)})", field="points"
            )
    layers = tuple(request.layers) or tuple(range(patching.num_layers))
    bad = [layer for layer in layers if type(layer) is not int or not 0 <= layer < patching.num_layers]
    if bad or len(set(layers)) != len(layers):
        raise InvalidArgument(
            f"layers must be distinct layers of this model (0..{patching.num_layers - 1}), got {bad or layers}",
            field="layers",
        )
    positions = tuple(request.positions) or tuple(range(len(request.clean)))
    bad = [p for p in positions if type(p) is not int or not 0 <= p < len(request.clean)]
    if bad or len(set(positions)) != len(positions):
        raise InvalidArgument(
            f"positions must be distinct positions of the prompt (0..{len(request.clean) - 1}), got {bad or positions}",
            field="positions",
        )
    cells = len(request.points) * len(layers) * len(positions)
    if cells > MAX_CELLS:
        raise InvalidArgument(f"the sweep asks for {cells} patched runs; at most {MAX_CELLS}", field="positions")
    return layers, positions
