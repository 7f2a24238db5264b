"""Engine side of concept readouts: ask the worker for captured blocks, hand them out.

Readouts are captured in the worker (readout_worker.py) as a step runs and
fetched with `collective_rpc` between steps. Many generations want theirs at
about the same moment (one engine step serves them all), so fetches coalesce:
a generation that needs data joins the fetch in flight, or starts one that
takes every registered key at once.

Position semantics: the residual at position p exists once token p has been
fed through the model. For a prompt position that is the prefill; for a
decoded token it is the step *after* it was sampled. So a decoded token's
event is held back one step until its readout has been captured; the last
token of a generation, never fed back, is read out by one more pass
(`Generation`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from salience.core.atomic import build_folder_once
from salience.core.concepts import ConceptSet
from salience.core.home import salience_home
from salience.errors import EngineError, InvalidArgument

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["ReadoutHub", "check_ranges", "tap_engine_args"]

Readout = tuple[float, ...]


def check_ranges(ranges: Sequence[tuple[int, int]]) -> list[list[int]]:
    checked = []
    for i, pair in enumerate(ranges):
        try:
            start, end = pair
        except (TypeError, ValueError):
            raise InvalidArgument(f"readout range {i} must be [start, end]") from None
        if type(start) is not int or type(end) is not int or not 0 <= start < end < 2**62:
            raise InvalidArgument(f"readout range {i} must satisfy 0 <= start < end, got [{start!r}, {end!r}]")
        checked.append([start, end])
    return checked


def tap_engine_args(concepts: ConceptSet | None, steering_set: ConceptSet | None, steering: bool) -> dict:
    """The vLLM engine arguments that put taps into the model (readout_graph.py): readouts
    with a concept set, steering along its vectors and the steering set's unless `steering`
    is off.

    The taps load the vectors from content-addressed copies of the sets; their digests in
    `additional_config` key vLLM's compile cache, so other sets never reuse a graph compiled
    for these.
    """
    from salience.core.readout_graph import CONFIG_KEY, LOAD_FORMAT, STEERING_KEY

    config: dict = {}
    if concepts is not None:
        config[CONFIG_KEY] = {**_stored(concepts), "layers": list(concepts.layers)}
    if steering and (concepts is not None or steering_set is not None):
        config[STEERING_KEY] = {"version": 1, "steering": _stored(steering_set) if steering_set is not None else None}
    return {
        "worker_extension_cls": "salience.core.worker.SalienceWorker",
        "load_format": LOAD_FORMAT,
        "additional_config": config,
    }


def _stored(concept_set: ConceptSet) -> dict:
    """A content-addressed copy of the set under $SALIENCE_HOME: its path and file digest."""
    from salience.core.readout_graph import file_digest

    digest = concept_set.digest()
    folder = build_folder_once(
        salience_home() / "concept-sets" / digest[:24], lambda out: concept_set.save(out / "concepts.safetensors")
    )
    path = folder / "concepts.safetensors"
    return {"path": str(path), "sha256": file_digest(path)}


class ReadoutHub:
    def __init__(self, llm: AsyncLLM, concepts: ConceptSet) -> None:
        self._llm = llm
        self.manifest = concepts.manifest
        self.width = len(concepts.layers) * len(concepts.concepts)
        self._buffers: dict[str, dict[int, Readout]] = {}
        self._dropped: set[str] = set()
        self._inflight: asyncio.Task | None = None

    @staticmethod
    async def install(llm: AsyncLLM, concepts: ConceptSet) -> ReadoutHub:
        shape = (await llm.collective_rpc("salience_readout_setup"))[0]
        expected = [len(concepts.layers), len(concepts.concepts)]
        if shape[1:] != expected:
            raise EngineError(f"the worker's readout buffer is {shape}, not [rows, {expected[0]}, {expected[1]}]")
        return ReadoutHub(llm, concepts)

    def register(self, key: str) -> None:
        self._buffers[key] = {}

    def release(self, key: str) -> None:
        """The request is over (finished, failed or aborted): forget its blocks here and in the worker."""
        self._buffers.pop(key, None)
        self._dropped.add(key)

    async def take(self, key: str, positions: Sequence[int]) -> dict[int, Readout]:
        """Readouts at `positions` (those captured by now), removed from the buffer."""
        buffer = self._buffers[key]
        for _ in range(3):  # a fetch already in flight may predate the step we wait for
            if all(p in buffer for p in positions):
                break
            await self._fetch()
        return {p: buffer.pop(p) for p in positions if p in buffer}

    def tracked(self) -> int:
        """Requests whose readouts this side still buffers."""
        return len(self._buffers)

    async def stored_in_worker(self) -> int:
        await self._fetch()
        return (await self._llm.collective_rpc("salience_readout_stored"))[0]

    async def graph(self) -> dict:
        """The worker's taps and compiler counters (readout_worker.salience_readout_graph)."""
        return (await self._llm.collective_rpc("salience_readout_graph"))[0]

    async def _fetch(self) -> None:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.create_task(self._fetch_now())
        await asyncio.shield(self._inflight)

    async def _fetch_now(self) -> None:
        keys, dropped = list(self._buffers), list(self._dropped)
        self._dropped.clear()
        taken = (await self._llm.collective_rpc("salience_readout_take", args=(keys, dropped)))[0]
        for key, (positions, values) in taken.items():
            buffer = self._buffers.get(key)
            if buffer is None:
                continue
            rows = np.frombuffer(values, dtype=np.float32).reshape(-1, self.width)
            for position, row in zip(np.frombuffer(positions, dtype=np.int64).tolist(), rows, strict=True):
                buffer[position] = tuple(row.tolist())  # a recomputed position (preemption) wins
