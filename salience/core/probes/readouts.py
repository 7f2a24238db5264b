"""Engine side of concept readouts: receive the captured blocks, hand them out.

Readouts are captured in the worker (readout_worker.py) as a step runs. They reach
this process one of two ways (docs/readouts.md, "Transport"):

- **With the step's output** (CPU, one pipeline stage): the worker attaches them to
  the step's ModelRunnerOutput, the engine core's scheduler (readout_scheduler.py)
  puts each request's rows into its EngineCoreOutput, and this hub takes them out
  in vLLM's output processor, before the request's output is queued. When a
  generation sees a token, the readouts of every token before it are already here.
- **Fetched** (pipeline parallelism, where each stage holds some layers and only the
  last stage's output returns): `collective_rpc` between steps. Many generations
  want theirs at about the same moment (one engine step serves them all), so
  fetches coalesce: a generation that needs data joins the fetch in flight, or
  starts one that takes every registered key at once. Each stage's TP-rank-0 worker
  files blocks holding the readout slots (layers) that stage holds and zeros
  elsewhere; stages run a step at different moments, so a fetch may see stage 0's
  rows of a step before stage 1's. A position is handed out only once every filing
  stage has sent it: its row is assembled slot by slot from the stage that holds
  each slot (exact: nothing is added).

Data parallelism: each DP engine has its own workers and scheduler; a request's
readouts come from the engine that ran it (`origin`, for tests). Fetched, the hub
calls each engine itself (vLLM's DP client returns only the first engine's answer
to a utility call); with the output, the scheduler names its engine.

Position semantics: the residual at position p exists once token p has been
fed through the model. For a prompt position that is the prefill; for a
decoded token it is the step *after* it was sampled. So a decoded token's
event is held back one step until its readout has been captured; the last
token of a generation, never fed back, is read out by one more pass
(`Generation`).
"""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from salience.core.probes.concepts import ConceptSet
from salience.core.probes.live import ConceptTable
from salience.core.probes.readout_scheduler import PAYLOAD
from salience.errors import EngineError, InvalidArgument

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["READ_TO_END", "ReadoutHub", "check_ranges", "each_engine", "float32_row"]

Readout = tuple[float, ...]
READ_TO_END = 2**62 - 1  # a range end past any position: "every position from start on"


@functools.cache
def float32_row(n: int) -> struct.Struct:
    """A row of n little-endian float32, as readouts travel: unpacked straight into Python floats
    (a row of 180: 2 us, numpy's array and tolist 3.6), packed from them (1 us, numpy 5)."""
    return struct.Struct(f"<{n}f")


def check_ranges(ranges: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The ranges as lists; an error's field is the range's index (`[2]`), under the caller's field."""
    checked = []
    for i, pair in enumerate(ranges):
        try:
            start, end = pair
        except (TypeError, ValueError):
            raise InvalidArgument(f"readout range {i} must be [start, end]", field=f"[{i}]") from None
        if type(start) is not int or type(end) is not int or not 0 <= start < end <= READ_TO_END:
            raise InvalidArgument(
                f"readout range {i} must satisfy 0 <= start < end, got [{start!r}, {end!r}]", field=f"[{i}]"
            )
        checked.append([start, end])
    return checked


class ReadoutHub:
    def __init__(
        self,
        llm: AsyncLLM,
        concepts: ConceptSet,
        stages: dict[int, Sequence[int]] | None = None,
        engines: int = 1,
        with_output: bool = False,
        spare: int = 0,
    ) -> None:
        """`stages`: for each filing worker (its index in collective_rpc's answers), the readout
        slots it holds; by default worker 0 holds them all. `engines`: data-parallel engines, each
        with the same workers. `with_output`: rows come with the steps' outputs (one filing
        worker), else they are fetched."""
        self._llm = llm
        self._engines = engines
        self.with_output = with_output
        self.origin: dict[str, int] = {}  # request id -> the DP engine its readouts came from (tests)
        self.table = ConceptTable(concepts, spare)
        self._layers = len(concepts.layers)
        stages = stages if stages is not None else {0: range(len(concepts.layers))}
        # Per filing worker, which read layers (slots) of a readout row it supplies.
        self._masks: dict[int, np.ndarray] = {}
        for worker, slots in stages.items():
            mask = np.zeros(len(concepts.layers), dtype=bool)
            mask[list(slots)] = True
            self._masks[worker] = mask
        self._widths: dict[str, int] = {}  # per request: the concepts in its rows (its view's)
        self._raw: dict[str, int] = {}  # keys whose rows stay arrays: their layer count
        self._buffers: dict[str, dict[int, Readout]] = {}
        # Positions some stages have sent and others not yet: [row so far, workers that sent it].
        self._partial: dict[str, dict[int, tuple[np.ndarray, set[int]]]] = {}
        self._dropped: set[str] = set()
        self._inflight: asyncio.Task | None = None

    @property
    def manifest(self):
        """The concepts a request starting now reads (live ones included)."""
        return self.table.view.manifest

    @staticmethod
    async def install(
        llm: AsyncLLM, concepts: ConceptSet, engines: int = 1, with_output: bool = False, spare: int = 0
    ) -> ReadoutHub:
        """Set the workers up and return the hub. `with_output` needs the engine core to run
        readout_scheduler.ReadoutScheduler (vllm_args.engine_args); `spare`: the taps' columns for
        live concepts (live.py)."""
        per_engine = await each_engine(llm, engines, "salience_readout_setup", (with_output,))
        if any(answers != per_engine[0] for answers in per_engine):
            raise EngineError(f"the data-parallel engines' readout workers differ: {per_engine}")
        answers = per_engine[0]
        expected = [len(concepts.layers), len(concepts.concepts) + spare]
        stages = {}
        for worker, answer in enumerate(answers):
            if answer is None or not answer["slots"]:  # a TP rank > 0, or a stage without readout layers
                continue
            if answer["shape"][1:] != expected:
                raise EngineError(
                    f"worker {worker}'s readout buffer is {answer['shape']}, not [rows, {expected[0]}, {expected[1]}]"
                )
            stages[worker] = answer["slots"]
        held = sorted(slot for slots in stages.values() for slot in slots)
        if held != list(range(len(concepts.layers))):
            raise EngineError(
                f"the workers' readout taps hold slots {held} of {len(concepts.layers)}: "
                "the engine was not started with the readout loader"
            )
        if with_output and len(stages) != 1:
            raise EngineError(f"readouts come with the step's output from one worker, not {len(stages)}")
        hub = ReadoutHub(llm, concepts, stages, engines, with_output, spare)
        if with_output:
            llm.output_processor.process_outputs = hub._receiving(llm.output_processor.process_outputs)
        return hub

    def register(self, key: str, concepts: int, raw_layers: int | None = None) -> None:
        """Expect readouts for `key`, rows of `concepts` values per read layer; with `raw_layers`,
        rows of `concepts` values per each of that many layers, handed out as float32 arrays
        [layers, concepts] (residual rows), not tuples."""
        self._widths[key] = concepts
        if raw_layers is not None:
            self._raw[key] = raw_layers
        self._buffers[key] = {}
        self._partial[key] = {}

    def release(self, key: str) -> None:
        """The request is over (finished, failed or aborted): forget its blocks here and in the worker."""
        self._widths.pop(key, None)
        self._raw.pop(key, None)
        self._buffers.pop(key, None)
        self._partial.pop(key, None)
        if not self.with_output:  # with the output, the worker keeps nothing past a step
            self._dropped.add(key)

    async def take(self, key: str, positions: Sequence[int]) -> dict[int, Readout]:
        """Readouts at `positions` (those captured by now, on every stage), removed from the buffer."""
        buffer = self._buffers[key]
        for _ in range(0 if self.with_output else 3):  # a fetch in flight may predate the step we wait for
            if all(p in buffer for p in positions):
                break
            await self._fetch()
        return {p: buffer.pop(p) for p in positions if p in buffer}

    def tracked(self) -> int:
        """Requests whose readouts this side still buffers."""
        return len(self._buffers)

    async def stored_in_worker(self) -> int:
        if not self.with_output:
            await self._fetch()
        per_engine = await each_engine(self._llm, self._engines, "salience_readout_stored")
        return sum(stored[worker] for stored in per_engine for worker in self._masks)

    async def graph(self) -> dict:
        """The worker's taps and compiler counters (readout_worker.salience_readout_graph): the
        first worker's counters, and the taps of every pipeline stage."""
        answers = await self._llm.collective_rpc("salience_readout_graph")
        return {**answers[0], "taps": sum(answers[worker]["taps"] for worker in self._masks)}

    async def _fetch(self) -> None:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.create_task(self._fetch_now())
        await asyncio.shield(self._inflight)

    async def _fetch_now(self) -> None:
        keys, dropped = list(self._buffers), list(self._dropped)
        self._dropped.clear()
        per_engine = await each_engine(self._llm, self._engines, "salience_readout_take", (keys, dropped))
        for engine, answers in enumerate(per_engine):
            self._file(engine, answers)

    def _receiving(self, process_outputs):
        """Wrap vLLM's OutputProcessor.process_outputs: file the rows a step's outputs carry
        before the requests' outputs are queued for their generators."""
        (worker,) = self._masks  # the one filing worker (install checked it)

        def run(outputs, *args, **kwargs):
            for output in outputs:
                params = output.kv_transfer_params
                if params is None or PAYLOAD not in params:
                    continue
                payload = params.pop(PAYLOAD)
                if not params:
                    output.kv_transfer_params = None
                for key, positions, values in payload["blocks"]:
                    self._file_block(payload["engine"], worker, key, positions, values)
            return process_outputs(outputs, *args, **kwargs)

        return run

    def _file(self, engine: int, answers: list) -> None:
        for worker in self._masks:
            for key, (positions, values) in answers[worker].items():
                self._file_block(engine, worker, key, positions, values)

    def _file_block(self, engine: int, worker: int, key: str, positions: bytes, values: bytes) -> None:
        buffer = self._buffers.get(key)
        if buffer is None:
            return
        if self._engines > 1:
            self.origin[key] = engine
            if len(self.origin) > 4096:  # the most recent requests only
                del self.origin[next(iter(self.origin))]
        concepts = self._widths[key]
        layers = self._raw.get(key, self._layers)
        width = layers * concepts
        positions = np.frombuffer(positions, dtype=np.int64).tolist()
        if len(self._masks) == 1 and key not in self._raw:  # a recomputed position (preemption) wins
            for position, row in zip(positions, float32_row(width).iter_unpack(values), strict=True):
                buffer[position] = row
            return
        rows = np.frombuffer(values, dtype=np.float32).reshape(-1, width)
        if key in self._raw:  # residual rows: one stage (the engine checks), kept as arrays
            block = rows.reshape(-1, layers, concepts).copy()  # one copy out of the read-only message
            for position, row in zip(positions, block, strict=True):
                buffer[position] = row
            return
        mask, partial = np.repeat(self._masks[worker], concepts), self._partial[key]
        for position, row in zip(positions, rows, strict=True):
            merged, sent = partial.setdefault(position, (np.zeros(width, dtype=np.float32), set()))
            merged[mask] = row[mask]
            sent.add(worker)
            if len(sent) == len(self._masks):
                buffer[position] = tuple(merged.tolist())
                del partial[position]


async def each_engine(llm: AsyncLLM, engines: int, method: str, args: tuple = ()) -> list[list]:
    """collective_rpc on every data-parallel engine: per engine, its workers' answers in rank order."""
    if engines == 1:
        return [await llm.collective_rpc(method, args=args)]
    return await llm.engine_core.call_utility_all_async("collective_rpc", method, None, args, None)
