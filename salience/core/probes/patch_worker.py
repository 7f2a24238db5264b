"""Inside the vLLM worker: hand each step's patched rows to the patch taps before the model runs.

A request asks to be patched through `SamplingParams.extra_args[TAG]`, its patches' absolute
form (patching.ResolvedPatches.payload): `[slot, positions, rows bytes]` each. `salience_patch_setup`
wraps the model runner's `_model_forward`, as the steering worker does: before the forward, for
every patched request, the step's rows whose absolute positions a patch names get that patch's
row for the position, gathered per slot into tap_ops.Patched; after it, the plans are dropped.
A step with no patched request costs one scan of the batch's request ids.

A failure fails only the requests patching where it happened (faults.py): the op's at a slot
fails the requests patching there this step, this code's the request it was planning.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from salience.core.probes.faults import taken
from salience.core.probes.step_requests import Plans, step_rows, tagged
from salience.core.probes.tap_ops import Patched
from salience.core.probes.taps import patch_taps

TAG = "salience_patch"
PATCH_OPS = frozenset({"patch"})

__all__ = ["TAG", "PatchWorker"]


class PatchWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_patch_setup(self) -> list[int] | None:
        """Start planning patches; returns the patch slots this stage's taps hold (None: it holds none)."""
        runner = self.model_runner
        found = patch_taps(runner.get_model())
        if not found:
            return None
        self._pa_sites = {slot: str(tap.site) for slot, tap in found.items()}  # what a fault names
        self._pa_device = next(runner.get_model().parameters()).device
        self._pa_hidden = runner.model_config.get_hidden_size()
        self._pa_plans = Plans(runner, self._pa_parse)
        self._pa_patching: dict[str, frozenset[int]] = {}  # this step's patched requests: their slots
        runner._model_forward = self._pa_around(runner._model_forward)
        return sorted(found)

    def salience_patch_plans(self) -> int:
        """Requests whose parsed patches this worker holds (tests: nothing stays behind)."""
        self._pa_plans.forget()
        return len(self._pa_plans)

    def _pa_around(self, model_forward):
        @functools.wraps(model_forward)
        def run(*args, **kwargs):
            try:
                self._pa_write()
            except Exception as exc:  # not one request's: every patched request of the step fails
                Patched.plans = {}
                self._ft_fail([r for _, r, _ in tagged(self.model_runner, TAG)], "planning the step's patches", exc)
            try:
                return model_forward(*args, **kwargs)
            finally:
                if Patched.plans:
                    for op, slot, exc in taken(PATCH_OPS):
                        patching = [r for r, slots in self._pa_patching.items() if slot in slots]
                        self._ft_fail(patching, f"salience::{op} at {self._pa_sites[slot]}", exc)
                    Patched.plans = {}
                self._pa_patching = {}

        return run

    def _pa_write(self) -> None:
        """This step's rows and values per slot (tap_ops.Patched), from every patched request."""
        runner = self.model_runner
        step = None
        rows: dict[int, list[np.ndarray]] = {}
        values: dict[int, list[torch.Tensor]] = {}
        for i, request_id, extra in tagged(runner, TAG):
            if step is None:
                step = step_rows(runner)
            starts, positions = step
            at, first = positions[starts[i] : starts[i + 1]], int(starts[i])
            try:
                mine: set[int] = set()
                for slot, wanted, table in self._pa_plans.of(request_id, extra[TAG]):
                    hit = np.isin(at, wanted)
                    if not hit.any():
                        continue
                    index = np.searchsorted(wanted, at[hit]) if len(table) > 1 else np.zeros(int(hit.sum()), int)
                    rows.setdefault(slot, []).append(np.nonzero(hit)[0] + first)
                    values.setdefault(slot, []).append(table[torch.from_numpy(index)])
                    mine.add(slot)
            except Exception as exc:  # its own patches: it alone fails
                self._ft_fail([request_id], "planning the step's patches", exc)
                continue
            if mine:
                self._pa_patching[request_id] = frozenset(mine)
        Patched.plans = {
            slot: (
                torch.from_numpy(np.concatenate(rows[slot])).to(self._pa_device),
                torch.cat(values[slot]).to(self._pa_device),
            )
            for slot in rows
        }

    def _pa_parse(self, payload: list) -> list:
        """The payload as (slot, sorted positions, [rows, hidden] float32 values in their order),
        slots this stage holds only."""
        plan = []
        for slot, positions, data in payload:
            if slot not in self._pa_sites:  # another pipeline stage's
                continue
            table = torch.from_numpy(np.frombuffer(data, dtype=np.float32).copy())
            table = table.view(-1, self._pa_hidden)
            wanted = np.asarray(positions, dtype=np.int64)
            order = np.argsort(wanted)
            if len(table) > 1:
                table = table[torch.from_numpy(order)]
            plan.append((slot, wanted[order], table))
        return plan
