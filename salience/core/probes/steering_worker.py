"""Inside the vLLM worker: write each step's steering coefficients before the model runs.

Theory of operation. The taps (taps.Tap) add
`(a + b * p + clamp(p, lo, hi) - p) @ D.T` to the residual (p = h @ D), reading a, b, lo and hi
from four static buffers `[max_tokens, steering layers, directions]`. Those buffers hold
(0, 0, -inf, inf) except during the forward of a step that holds a steered request:

- A request asks for steering through `SamplingParams.extra_args[TAG]`, the absolute form of
  its interventions (steering.ResolvedSteer.payload): `[layers, column, a, b, ranges, lo, hi,
  vector]` each. A request's own vector is written, unit-normalised, into its column of every
  tap's D before the first step that needs it (the engine gives one vector a column at a time).
- `salience_steering_setup` wraps the model runner's `_model_forward`, which vLLM calls from
  `execute_model` once the step's inputs are prepared: `input_batch.req_ids` in row order,
  `query_start_loc` and `positions` for this step. (vLLM's dummy and profiling runs call the
  model directly and see zeros.) For every steered request it adds each intervention's (a, b)
  at the rows whose absolute positions its ranges cover, for each of its layers; then runs the
  forward; then resets the rows it wrote. Interventions that meet at one row, layer and
  direction add up, and caps intersect (steering.py defines both).
- It also names the slots (layers) this step steers at (tap_ops.Steered): on CPU a tap steers
  through the op `salience::steer`, which does nothing at any other slot. A step with no steered
  request costs one dictionary lookup per request and one set lookup per steerable layer: the
  buffers are already zero.

Every rank steers (each runs the whole residual stream under tensor parallelism).

A failure fails only the requests steering where it happened (faults.py): the op's at a layer
fails those steering at that layer this step, and this code's the request it was writing (the
rows it wrote are its own), or every steered request of the step if it was not one request's.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from salience.core.probes.faults import taken
from salience.core.probes.steering import unit
from salience.core.probes.step_requests import Plans, step_rows, tagged
from salience.core.probes.tap_ops import Steered
from salience.core.probes.taps import steering_buffers, steering_taps

TAG = "salience_steer"
RESET = (0.0, 0.0, -np.inf, np.inf)  # a, b, lo, hi of a row nobody steers
STEER_OPS = frozenset({"steer"})

__all__ = ["TAG", "SteeringWorker"]


class SteeringWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_steering_setup(self) -> list[int] | None:
        """Start writing coefficients; returns the buffers' shape [rows, layers, directions], or
        None on a pipeline stage that holds no steerable layer (it has nothing to write)."""
        runner = self.model_runner
        found = steering_buffers(runner.get_model())
        if found is None:
            return None
        buffers, slots = found
        self._st_buffers = buffers
        # Written on the host: the buffers themselves on CPU, a staging copy on an accelerator.
        on_cpu = buffers[0].device.type == "cpu"
        self._st_host = tuple((b if on_cpu else b.cpu().pin_memory()).numpy() for b in buffers)
        self._st_slots = slots
        self._st_taps = steering_taps(runner.get_model())
        self._st_layers = {slot: index for index, slot in slots.items()}  # what a fault names
        self._st_steering: dict[str, frozenset[int]] = {}  # this step's steered requests: the slots each steers at
        self._st_plans = Plans(runner, self._st_parse)
        self._st_vectors: dict[int, str] = {}  # vector column -> the identity of the vector it holds
        runner._model_forward = self._st_around(runner._model_forward)
        return list(buffers[0].shape)

    def salience_direction_write(self, column: int, vectors: dict[int, bytes] | None) -> None:
        """Column `column` of every steering tap's D: the unit vector of `vectors[layer]`
        (float32 bytes), or zero (None, or a layer not given)."""
        units: dict[int, torch.Tensor] = {}  # one normalisation per distinct vector (a request's: one for all)
        for index, tap in self._st_taps.items():
            vector = vectors.get(index) if vectors else None
            if vector is None:
                tap.directions[:, column] = 0.0
                continue
            if id(vector) not in units:
                values = torch.from_numpy(np.frombuffer(vector, dtype=np.float32).copy())
                units[id(vector)] = unit(values).to(torch.float32)
            tap.directions[:, column] = units[id(vector)].to(tap.directions.device)

    def salience_steering_plans(self) -> int:
        """Requests whose parsed interventions this worker holds (tests: nothing stays behind)."""
        self._st_plans.forget()
        return len(self._st_plans)

    def _st_around(self, model_forward):
        @functools.wraps(model_forward)
        def run(*args, **kwargs):
            try:
                rows = self._st_write()
            except Exception as exc:  # not one request's: every steered request of the step fails
                rows = self.model_runner.max_num_tokens
                self._ft_fail(self._st_steered(), "writing the step's steering", exc)
            try:
                return model_forward(*args, **kwargs)
            finally:
                if rows:
                    self._st_faulted()
                    self._st_clear(rows)
                    Steered.slots = frozenset()
                    self._st_steering = {}

        return run

    def _st_write(self) -> int:
        """Fill this step's coefficients; returns how many rows may be non-zero."""
        runner = self.model_runner
        steered = []
        for i, request_id, extra in tagged(runner, TAG):
            try:
                steered.append((request_id, i, self._st_plans.of(request_id, extra[TAG])))
            except Exception as exc:  # its own payload: it alone fails
                self._ft_fail([request_id], "reading the steering interventions", exc)
        if not steered:
            return 0
        starts, positions = step_rows(runner)
        total = len(positions)
        slots: set[int] = set()
        for request_id, i, plan in steered:
            s, e = int(starts[i]), int(starts[i + 1])
            try:
                mine = self._st_write_rows(plan, s, positions[s:e])
            except Exception as exc:  # its own interventions: it alone fails (its rows are its own)
                self._ft_fail([request_id], "writing the steering coefficients", exc)
                continue
            if mine:
                self._st_steering[request_id] = mine
                slots |= mine
        if self._st_buffers[0].device.type != "cpu":
            for device, host in zip(self._st_buffers, self._st_host, strict=True):
                device[:total].copy_(torch.from_numpy(host[:total]))
        Steered.slots = frozenset(slots)  # the taps that steer this step (tap_ops.steer)
        return total

    def _st_write_rows(self, plan: list, first: int, positions: np.ndarray) -> frozenset[int]:
        """Add one request's interventions at its rows (from `first`, at `positions`); returns the
        slots it steers at in this step."""
        add, scale, low, high = self._st_host
        slots: set[int] = set()
        for layers, column, a, b, ranges, lo, hi, vector in plan:
            covered = np.zeros(len(positions), dtype=bool)
            for start, end in ranges:
                covered |= (positions >= start) & (positions < end)
            rows = np.nonzero(covered)[0] + first
            if not len(rows):
                continue
            if vector is not None and self._st_vectors.get(column) != vector[0]:
                self._st_write_vector(column, vector)
            slots.update(layers.tolist())
            index = (rows[:, None], layers[None, :], column)
            add[index] += a
            scale[index] += b
            if lo != -np.inf:
                low[index] = np.maximum(low[index], lo)
            if hi != np.inf:
                high[index] = np.minimum(high[index], hi)
        return frozenset(slots)

    def _st_steered(self) -> list[str]:
        """This step's requests that asked to be steered."""
        return [request_id for _, request_id, _ in tagged(self.model_runner, TAG)]

    def _st_faulted(self) -> None:
        """Fail the requests steering where the op failed: at that slot, in this step."""
        for op, slot, exc in taken(STEER_OPS):
            steering = [request_id for request_id, slots in self._st_steering.items() if slot in slots]
            self._ft_fail(steering, f"salience::{op} at layer {self._st_layers[slot]}", exc)

    def _st_write_vector(self, column: int, vector: list) -> None:
        identity, values = vector
        self.salience_direction_write(column, dict.fromkeys(self._st_slots, values))
        self._st_vectors[column] = identity

    def _st_clear(self, rows: int) -> None:
        for host, fill in zip(self._st_host, RESET, strict=True):
            host[:rows] = fill
        if self._st_buffers[0].device.type != "cpu":
            for device, fill in zip(self._st_buffers, RESET, strict=True):
                device[:rows].fill_(fill)

    def _st_parse(self, payload: list) -> list:
        """The payload with layers mapped to buffer slots."""
        plan = []
        for layers, column, a, b, ranges, lo, hi, vector in payload:
            # Under pipeline parallelism a stage holds some layers only; the others' stages steer those.
            slots = [self._st_slots[layer] for layer in layers if layer in self._st_slots]
            if slots:
                plan.append((np.array(slots, dtype=np.int64), column, a, b, ranges, lo, hi, vector))
        return plan
