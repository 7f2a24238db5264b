"""Imported by the fork server (fork_server.py), never elsewhere: compiles vLLM's one
torch.compile'd sampler op there, once, so no forked engine compiles it again.

vLLM ranks each sampled or prompt token among its logprobs with `batched_count_greater_than`,
compiled by inductor at its first call in a process: ~3 s of every start on two cores (the
engine's warm-up pays it, startup.py). Compiled here, the compiled function is in the memory every
forked process starts from. It is called as vLLM calls it (inference mode, the batch dimension
unbacked) at two vocabulary sizes, so the graph it keeps takes any vocabulary. One thread: the
fork server must start no OpenMP pool (a forked child cannot use its parent's), and inductor
compiles its kernels for the thread count of the moment, which on CPU is what an engine runs with
too (vLLM reduces it to one per rank on these machines); the count is put back after.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def _compile_rank_op() -> None:
    from torch._inductor import config
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    threads, compile_threads = torch.get_num_threads(), config.compile_threads
    torch.set_num_threads(1)
    config.compile_threads = 1  # no pool of compile workers in a process that forks
    try:
        with torch.inference_mode():
            for batch, vocabulary in ((2, 2048), (3, 4096)):
                logprobs = torch.randn(batch, vocabulary).log_softmax(-1)
                chosen = logprobs.gather(-1, torch.zeros(batch, 1, dtype=torch.int64))
                torch._dynamo.decorators.mark_unbacked(logprobs, 0)
                torch._dynamo.decorators.mark_unbacked(chosen, 0)
                batched_count_greater_than(logprobs, chosen)
    finally:
        torch.set_num_threads(threads)
        config.compile_threads = compile_threads


try:
    _compile_rank_op()
except Exception:  # an engine then compiles it itself, as a spawned one does
    log.warning("the fork server could not compile vLLM's rank op", exc_info=True)
