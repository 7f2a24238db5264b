"""Inside the vLLM worker: write each step's steering coefficients before the model runs.

Theory of operation. The taps (taps.LayerTap) add `(a + b * (h @ D)) @ D.T` to the
residual, reading a and b from two static buffers `[max_tokens, steering layers, directions]`.
Those buffers are all zeros except during the forward of a step that holds a steered request:

- A request asks for steering through `SamplingParams.extra_args[TAG]`, the absolute form of
  its interventions (steering.ResolvedSteer.payload): `[layers, column, a, b, ranges]` each.
- `salience_steering_setup` wraps the model runner's `_model_forward`, which vLLM calls from
  `execute_model` once the step's inputs are prepared: `input_batch.req_ids` in row order,
  `query_start_loc` and `positions` for this step. (vLLM's dummy and profiling runs call the
  model directly and see zeros.) For every steered request it adds each intervention's (a, b)
  at the rows whose absolute positions its ranges cover, for each of its layers; then runs the
  forward; then zeroes the rows it wrote. Interventions that meet at one row, layer and
  direction add up (steering.py defines the sum).
- A step with no steered request costs one dictionary lookup per request: the buffers are
  already zero.

Every rank steers (each runs the whole residual stream under tensor parallelism).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from salience.core.probes.taps import steering_buffers

TAG = "salience_steer"

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
        add, scale, slots = found
        self._st_buffers = (add, scale)
        # Written on the host: the buffers themselves on CPU, a staging copy on an accelerator.
        on_cpu = add.device.type == "cpu"
        self._st_host = tuple(
            (b if on_cpu else torch.zeros(b.shape, dtype=b.dtype, pin_memory=True)).numpy() for b in (add, scale)
        )
        self._st_slots = slots
        self._st_plans: dict[str, tuple[object, list]] = {}
        runner._model_forward = self._st_around(runner._model_forward)
        return list(add.shape)

    def salience_steering_plans(self) -> int:
        """Requests whose parsed interventions this worker holds (tests: nothing stays behind)."""
        self._st_forget()
        return len(self._st_plans)

    def _st_around(self, model_forward):
        @functools.wraps(model_forward)
        def run(*args, **kwargs):
            rows = self._st_write()
            try:
                return model_forward(*args, **kwargs)
            finally:
                if rows:
                    self._st_clear(rows)

        return run

    def _st_write(self) -> int:
        """Fill this step's coefficients; returns how many rows may be non-zero."""
        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        steered = []
        for i, request_id in enumerate(batch.req_ids[:n]):
            state = runner.requests.get(request_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if extra and TAG in extra:
                steered.append((i, self._st_plan(request_id, extra[TAG])))
        if not steered:
            return 0
        starts = runner.query_start_loc.cpu[: n + 1].numpy()
        total = int(starts[n])
        positions = runner.positions[:total].cpu().numpy()
        add, scale = self._st_host
        for i, plan in steered:
            s, e = int(starts[i]), int(starts[i + 1])
            pos = positions[s:e]
            for slots, column, a, b, ranges in plan:
                covered = np.zeros(e - s, dtype=bool)
                for start, end in ranges:
                    covered |= (pos >= start) & (pos < end)
                rows = np.nonzero(covered)[0] + s
                if len(rows):
                    index = (rows[:, None], slots[None, :], column)
                    add[index] += a
                    scale[index] += b
        if self._st_buffers[0].device.type != "cpu":
            for device, host in zip(self._st_buffers, self._st_host, strict=True):
                device[:total].copy_(torch.from_numpy(host[:total]))
        return total

    def _st_clear(self, rows: int) -> None:
        for host in self._st_host:
            host[:rows] = 0
        if self._st_buffers[0].device.type != "cpu":
            for device in self._st_buffers:
                device[:rows].zero_()

    def _st_plan(self, request_id: str, payload: list) -> list:
        """The payload with layers mapped to buffer slots, parsed once per request."""
        cached = self._st_plans.get(request_id)
        if cached is not None and cached[0] is payload:
            return cached[1]
        if len(self._st_plans) > 4 * self.model_runner.max_num_reqs:
            self._st_forget()
        plan = []
        for layers, column, a, b, ranges in payload:
            # Under pipeline parallelism a stage holds some layers only; the others' stages steer those.
            slots = [self._st_slots[layer] for layer in layers if layer in self._st_slots]
            if slots:
                plan.append((np.array(slots, dtype=np.int64), column, a, b, ranges))
        self._st_plans[request_id] = (payload, plan)
        return plan

    def _st_forget(self) -> None:
        """Drop the plans of requests the runner no longer holds."""
        live = self.model_runner.requests
        for request_id in [r for r in self._st_plans if r not in live]:
            del self._st_plans[request_id]
