"""In the engine core: finish the requests a step's worker failed, and only those.

The worker puts them on the step's ModelRunnerOutput (faults.FAULTS: {request id: what failed}).
This scheduler (`scheduler_cls`, before vLLM's own in the class order) finishes each with vLLM's
error status before vLLM reads the step, so the step's token is not theirs to keep, and sends
each an output with finish reason `error` and what failed as its `stop_reason`: vLLM's own way
to end a request for a failure of its own (its grammar and KV-load errors), which the frontend
raises as EngineError (engine/output_streams.py). The KV blocks a faulted request holds leave
the prefix cache first: a failed steer computed them unsteered, and no later request may read them.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from salience.core.probes.faults import FAULTS

__all__ = ["FaultScheduler"]


class FaultScheduler(Scheduler):
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        faults: dict[str, str] = getattr(model_runner_output, FAULTS, None) or {}
        failed = [request_id for request_id in faults if request_id in self.requests]
        for request_id in failed:
            self.kv_cache_manager.evict_blocks(
                {b for group in self.kv_cache_manager.get_block_ids(request_id) for b in group}
            )
        requests = self.finish_requests(failed, RequestStatus.FINISHED_ERROR) if failed else []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in requests:
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=request.get_finished_reason(),
                stop_reason=faults[request.request_id],
                events=request.take_events(),
                trace_headers=request.trace_headers,
            )
            client = outputs.setdefault(request.client_index, EngineCoreOutputs(outputs=[]))
            client.outputs.append(output)
        return outputs
