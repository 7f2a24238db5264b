"""In the engine core: move each step's readout rows from the worker's output to the requests'.

vLLM's scheduler turns a step's ModelRunnerOutput into one EngineCoreOutput per request that
produced a token, and those travel to the frontend process in the message that already carries
the sampled tokens. This subclass (`scheduler_cls`) puts the rows the worker attached
(readout_worker.ROWS) into the output of the request they belong to, under
`kv_transfer_params[PAYLOAD]`: the one free-form field of EngineCoreOutput (a KV connector's
own keys, if one is configured, are kept beside it). The frontend takes them out again before
vLLM's output processor sees them (readouts.ReadoutHub).

A request's rows can precede its next output: a prefill split across steps produces no token
until its last chunk. They wait here until then, and are dropped once the request is gone
(finished or aborted) without one.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput

from salience.core.probes.readout_worker import ROWS

PAYLOAD = "salience_readout"

__all__ = ["PAYLOAD", "ReadoutScheduler"]


class ReadoutScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rows: dict[str, list[list]] = {}  # vLLM request id -> [key, positions, values] blocks
        # The DP engine this is (for a dense model vLLM resets data_parallel_rank to 0 in every one).
        self._engine = self.vllm_config.parallel_config.data_parallel_index

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        for request_id, blocks in (getattr(model_runner_output, ROWS, None) or {}).items():
            self._rows.setdefault(request_id, []).extend(blocks)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self._rows:
            return outputs
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                blocks = self._rows.pop(output.request_id, None)
                if blocks is not None:
                    payload = {"engine": self._engine, "blocks": blocks}
                    output.kv_transfer_params = {**(output.kv_transfer_params or {}), PAYLOAD: payload}
        for request_id in [r for r in self._rows if r not in self.requests]:
            del self._rows[request_id]
        return outputs
