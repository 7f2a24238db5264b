"""Live concepts on the running engine: what each request holds, and writing the taps' columns.

The bookkeeping is probes/live.py's ConceptTable; this module carries its decisions to the
workers. A define writes the new concept's column into every worker's readout matrices and
steering directions (collective_rpc, which vLLM runs between two steps) and only then publishes
it, so no request can name it before its vectors are in place. A deleted concept's column is
zeroed once the last request holding it has ended (Hold.release), and only then is it free.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.tap_config import capture_base, spare_columns, steers
from salience.core.engine.start.transport import readouts_with_output
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.live import ConceptTable, ConceptView, LiveConcept, VectorColumns, check_vectors
from salience.core.probes.patching import NO_PATCHES, PatchSites, ResolvedPatches
from salience.core.probes.readouts import ReadoutHub
from salience.core.probes.steering import Directions, ResolvedSteer
from salience.errors import EngineError, FailedPrecondition

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["Hold", "LiveConcepts", "install_probes"]

log = logging.getLogger(__name__)

# collective_rpc on every data-parallel engine's workers
Rpc = Callable[[str, tuple], Awaitable[object]]


@dataclass(eq=False)
class Hold:
    """What a request holds while it runs: the concepts it sees, columns for its own vectors, and
    its patches (a generation's last-token pass runs under the same)."""

    view: ConceptView | None
    steer: ResolvedSteer
    patch: ResolvedPatches = NO_PATCHES
    _release: Callable[[Hold], None] | None = None

    def release(self) -> None:
        """Safe to call twice."""
        release, self._release = self._release, None
        if release is not None:
            release(self)


class LiveConcepts:
    def __init__(
        self, table: ConceptTable | None, directions: Directions | None, rpc: Rpc, vector_columns: VectorColumns | None
    ) -> None:
        self.table = table
        self._steering = directions
        self._rpc = rpc
        self._vectors = vector_columns
        self._zeroing: set[asyncio.Task] = set()
        self._clearing: set[int] = set()  # columns being zeroed

    def hold(self, steer: ResolvedSteer, patch: ResolvedPatches = NO_PATCHES) -> Hold:
        """The current view, and `steer` with its vectors' columns claimed (ResourceExhausted if none
        is free). The caller releases the Hold when the request is over."""
        if self._vectors is not None and any(i.vector is not None for i in steer.interventions):
            steer = self._vectors.claim(steer)
        view = self.table.acquire() if self.table is not None else None
        return Hold(view, steer, patch, self._release)

    def view(self) -> ConceptView | None:
        return self.table.view if self.table is not None else None

    def directions(self) -> dict[str, tuple[int, str]]:
        """The live concepts a request starting now may steer along (steering.Directions.resolve)."""
        return self.table.view.directions if self.table is not None else {}

    def _release(self, hold: Hold) -> None:
        if self._vectors is not None and any(i.vector is not None for i in hold.steer.interventions):
            self._vectors.release(hold.steer)
        if hold.view is not None and self.table is not None:
            unheld = self.table.release(hold.view)
            if unheld:
                self._zero(unheld)

    # ---- define, delete, save ----------------------------------------------------------------

    def reserve(self, name: str) -> None:
        """Claim a name and a column before a define's (long) fit; `abandon` if the define fails."""
        self._table().reserve(name)

    def abandon(self, name: str) -> None:
        self._table().abandon(name)

    async def define(self, name: str, vectors: Mapping[int, torch.Tensor], info: dict | None) -> ConceptView:
        """Publish a reserved concept: its vectors (float32 [hidden] per read layer, used as given
        for readouts, unit-normalised for steering) go into its column, then it is in the view."""
        table = self._table()
        try:
            check_vectors(vectors, table.loaded.layers, table.loaded.hidden_size)
            column = table.column_for(name)
            concept = LiveConcept(
                name=name,
                column=column,
                vectors={layer: v.to(torch.float32) for layer, v in vectors.items()},
                info=info,
            )
            await self._write(column, concept.vectors)
        except BaseException:
            table.abandon(name)
            raise
        view = table.commit(concept)
        log.info("live concept defined", extra={"concept": name, "column": column, "version": view.version})
        return view

    def delete(self, name: str) -> ConceptView:
        table = self._table()
        concept = table.delete(name)
        unheld = table.unheld()
        if unheld:
            self._zero(unheld)
        log.info(
            "live concept deleted", extra={"concept": name, "column": concept.column, "version": table.view.version}
        )
        return table.view

    def served_set(self) -> ConceptSet:
        return self._table().served_set()

    async def settled(self) -> None:
        """Until every deleted column nobody holds is zeroed (tests)."""
        while self._zeroing:
            await asyncio.gather(*self._zeroing)

    def _table(self) -> ConceptTable:
        if self.table is None:
            raise FailedPrecondition("live concepts need concept readouts, and this server has no concept set loaded")
        return self.table

    async def _write(self, column: int, vectors: Mapping[int, torch.Tensor] | None) -> None:
        raw = {layer: v.contiguous().numpy().tobytes() for layer, v in vectors.items()} if vectors else None
        await self._rpc("salience_concept_write", (column, raw))
        if self._steering is not None:
            await self._rpc("salience_direction_write", (self._steering.live_column(column), raw))

    def _zero(self, columns: list[int]) -> None:
        table = self._table()
        columns = [column for column in columns if column not in self._clearing]
        if not columns:
            return
        self._clearing.update(columns)

        async def zero() -> None:
            for column in columns:
                await self._write(column, None)
            table.free(columns)
            self._clearing.difference_update(columns)

        task = asyncio.get_running_loop().create_task(zero())
        self._zeroing.add(task)
        task.add_done_callback(self._zeroing.discard)


async def install_probes(
    llm: AsyncLLM, settings: EngineSettings, cpu: bool, compiled: bool, rpc: Rpc
) -> tuple[ReadoutHub | None, Directions | None, PatchSites | None, LiveConcepts]:
    """Set the workers' taps up: readouts with a concept set, steering unless it is off, patching
    at the patch points, their failures failing requests instead of the engine (probes/faults.py),
    and the live concepts' bookkeeping over readouts and steering."""
    readouts = steering = patching = None
    if settings.concepts is not None:
        readouts = await ReadoutHub.install(
            llm,
            settings.concepts,
            settings.data_parallel_size,
            readouts_with_output(settings, cpu),
            spare_columns(settings),
        )
        log.info(
            "readouts on",
            extra={
                "layers": len(settings.concepts.layers),
                "mode": "compiled" if compiled else "eager",
                "transport": "step output" if readouts.with_output else "fetched",
            },
        )
    if steers(settings):
        directions = Directions(
            settings.concepts,
            settings.steering_set,
            spare=spare_columns(settings),
            vectors=settings.steer_vectors,
        )
        steering = await _install_steering(llm, directions)
    if settings.patch_points:
        patching = await _install_patching(llm, settings)
    if readouts is not None or steering is not None or patching is not None:  # last: it wraps what they wrapped
        await rpc("salience_faults_setup", ())
    live = LiveConcepts(
        readouts.table if readouts else None,
        steering,
        rpc,
        VectorColumns(steering.vector_columns) if steering else None,
    )
    return readouts, steering, patching, live


async def _install_patching(llm: AsyncLLM, settings: EngineSettings) -> PatchSites:
    model_config = llm.model_config
    sites = PatchSites(
        settings.patch_points,
        model_config.get_total_num_hidden_layers(),
        model_config.get_hidden_size(),
        capture_base(settings),
    )
    # Every worker that holds a layer patches it (each pipeline stage its own layers).
    held = sorted({slot for slots in await llm.collective_rpc("salience_patch_setup") if slots for slot in slots})
    if held != list(range(len(sites))):
        raise EngineError(f"the workers' patch taps hold slots {held}, not 0..{len(sites) - 1}")
    log.info("patching on", extra={"points": list(sites.points), "layers": sites.num_layers})
    return sites


async def _install_steering(llm: AsyncLLM, directions: Directions) -> Directions:
    # Every worker that holds a steerable layer writes coefficients (each pipeline stage its own layers).
    shapes = [shape for shape in await llm.collective_rpc("salience_steering_setup") if shape is not None]
    expected = [len(directions.layers), directions.width]
    if not shapes or any(shape[1:] != expected for shape in shapes):
        raise EngineError(f"the workers' steering buffers are {shapes}, not [rows, {expected[0]}, {expected[1]}]")
    log.info("steering on", extra={"directions": len(directions.names), "layers": len(directions.layers)})
    return directions
