"""Inside the vLLM worker: the model's own logprobs for the requests that ask for them.

vLLM picks one logprobs mode per engine, and Salience runs `processed_logprobs`: a sampled
token's logprobs describe the distribution it was drawn from (engine.py), LMTP's rule. The
OpenAI API promises what OpenAI and `vllm serve` give instead, vLLM's `raw_logprobs`: the
model's distribution before logit_bias, allowed_token_ids, min_tokens, the penalties, the
temperature and top-k / top-p / min-p. vLLM 0.32 has no per-request mode (its sampler's
`logprobs_mode_override` is never passed), so a request asks for it through
`SamplingParams.extra_args[RAW_LOGPROBS]` and `salience_logprobs_setup` wraps the sampler:

- before the sampler runs, the rows of the tagged requests (input_batch.req_ids, in row order)
  are log_softmax'ed out of the logits as they come in: what vLLM's `raw_logprobs` mode computes,
  a constraint's mask included (vLLM applies the grammar bitmask before its sampler). A copy,
  since the sampler changes the logits in place;
- after it, those rows' top-k, sampled-token logprob and rank are gathered from that copy with
  vLLM's own `gather_logprobs` and written over the processed ones.

The processed top-k could not give them: log_softmax(z) from log_softmax(z / T) needs the
whole vocabulary's values (raw_i = T * lp_i - logsumexp_j(T * lp_j)), and truncation leaves -inf
where the model has a value. The sampled tokens are untouched. A step with no tagged request (or
none asking for logprobs) runs the sampler as it was, after one scan of the batch's request ids; a
tagged row costs what vLLM's raw mode costs it: one log_softmax over the vocabulary and one top-k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from salience.core.probes.step_requests import tagged

__all__ = ["RAW_LOGPROBS", "LogprobsWorker"]

RAW_LOGPROBS = "salience_raw_logprobs"  # SamplingParams.extra_args key


class LogprobsWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_logprobs_setup(self) -> None:
        """Serve raw logprobs to the requests tagged RAW_LOGPROBS (idempotent)."""
        runner = self.model_runner
        sampler = getattr(runner, "sampler", None)
        if sampler is None or getattr(sampler.forward, "salience_raw", False):
            return
        sampler.forward = _with_raw_rows(sampler.forward, runner)


def _with_raw_rows(forward: Callable, runner: Any) -> Callable:
    import torch
    from vllm.v1.sample.sampler import Sampler

    @functools.wraps(forward)
    def run(logits: torch.Tensor, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        k = sampling_metadata.max_num_logprobs
        # Top-k logprobs asked for (not the whole vocabulary, -1, nor chosen ids, which Salience never asks).
        asked = k is not None and k >= 0 and not sampling_metadata.logprob_token_ids
        rows = [i for i, _, _ in tagged(runner, RAW_LOGPROBS)] if asked else None
        if not rows:
            return forward(logits, sampling_metadata, *args, **kwargs)
        index = torch.tensor(rows, device=logits.device)
        raw = Sampler.compute_logprobs(logits.index_select(0, index))
        out = forward(logits, sampling_metadata, *args, **kwargs)
        mine = Sampler.gather_logprobs(raw, k, token_ids=out.sampled_token_ids[index, 0].long())
        tensors = out.logprobs_tensors
        tensors.logprob_token_ids[index] = mine.logprob_token_ids
        tensors.logprobs[index] = mine.logprobs
        tensors.selected_token_ranks[index] = mine.selected_token_ranks
        return out

    run.salience_raw = True  # type: ignore[attr-defined]
    return run
