"""Starting an engine: settings checked, vLLM launched in its processes, the workers' hooks installed
(the server watch, raw logprobs, fair share, pipeline stages, readout and steering taps, SAEs), and
a warm-up, so that the first client's request pays for none of it. Serving is engine/engine.py's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TypeVar

from salience.core.engine.fair_share import admission
from salience.core.engine.images import Vision
from salience.core.engine.live import install_probes
from salience.core.engine.requests import SamplingOptions
from salience.core.engine.settings import EngineSettings
from salience.core.engine.start import environment, launch, settings_checks, vllm_args
from salience.core.engine.start.served_saes import served_saes

__all__ = ["start"]

E = TypeVar("E")  # the Engine class: engine/engine.py imports this module, not the other way round

log = logging.getLogger("salience.core.engine.engine")  # the engine's own log, as before the split


async def start(cls: type[E], settings: EngineSettings) -> E:
    """A `cls` engine on `settings`, ready to serve; its processes stopped if any step fails."""
    started = time.monotonic()
    cpu = environment.is_cpu()
    settings_checks.check(settings)
    env = environment.process_environment(settings, cpu)
    vision = await asyncio.to_thread(Vision.load, settings.model)
    compiled = vllm_args.compiled(settings)
    args = vllm_args.engine_args(settings, cpu, vision, compiled)
    llm = await launch.start_vllm(args, env, compiled, settings.fork_server)
    engine = cls(llm, settings, vision)
    engine.compiled = compiled
    try:
        if settings.distributed_executor_backend != "ray":  # Ray's workers run elsewhere
            await engine._rpc("salience_watch_server", (os.getpid(),))
        await engine._rpc("salience_logprobs_setup")
        engine.fair_share = admission(settings, llm.vllm_config.scheduler_config.max_num_seqs)
        if settings.pipeline_parallel_size > 1:
            await llm.collective_rpc("salience_pipeline_setup")
        probes = await install_probes(llm, settings, cpu, compiled, engine._rpc)
        engine.readouts, engine.steering, engine.patching, engine.live = probes
        engine.saes = served_saes(settings)
        await _warm_up(engine)
    except BaseException:
        engine.shutdown()
        raise
    log.info(
        "engine ready: %s in %.1f s",
        settings.served_model_name,
        time.monotonic() - started,
        extra={"mode": "compiled" if compiled else "eager"},
    )
    if engine.readouts is not None:
        budget = engine.row_budget
        log.info(
            "residual rows: at most %d per request, %d held at once (%.0f MiB of float32)",
            settings.max_residual_rows,
            budget.rows,
            budget.rows * budget.row_bytes / 2**20,
        )
    return engine


async def _warm_up(engine: E) -> None:
    # The first request with logprobs compiles a sampler op (20 s cold):
    # pay for it before reporting ready, for sampled and prompt logprobs.
    eos = engine.tokenizer.eos_token_id or 0
    prompt = [eos, min(1, engine.vocab_size - 1)]
    async for _ in engine.generate(prompt, SamplingOptions(max_tokens=2, logprobs=1, temperature=1.0, top_k=5)):
        pass
    async for _ in engine.generate(prompt, SamplingOptions(max_tokens=2, logprobs=1, temperature=0.0)):
        pass
    await engine.score(prompt[:1], prompt[1:], top_logprobs=1)
