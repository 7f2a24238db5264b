"""What a request may ask of one model, checked before vLLM sees it.

A bad request raises a typed error here and never reaches the engine process, whose own
checks would surface as a failed request, or, for a few, as a dead engine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from salience.core.engine.logprobs_worker import RAW_LOGPROBS
from salience.core.engine.requests import Constraint, SamplingOptions
from salience.errors import ContextOverflow, InvalidArgument

if TYPE_CHECKING:
    from vllm import SamplingParams

    from salience.core.engine.constraints import ConstraintBackend

__all__ = ["RequestChecks"]


@dataclass(frozen=True)
class RequestChecks:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    constraints: ConstraintBackend | None = None  # None: structured outputs are refused

    def tokens(self, what: str, ids: Sequence[int]) -> list[int]:
        """The ids as a list, or InvalidArgument naming the first that is not in the vocabulary."""
        ids = list(ids)
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)):
            return ids
        index, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < self.vocab_size)
        raise InvalidArgument(
            f"{what}[{index}] = {bad!r} is not a token id of this model (0..{self.vocab_size - 1})",
            field=f"{what}[{index}]",
        )

    def scoring(self, prompt: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], list[int]]:
        prompt = self.tokens("prompt", prompt)
        continuation = self.tokens("continuation", continuation)
        if not prompt:
            raise InvalidArgument("prompt is empty: the first token has no context to be scored in", field="prompt")
        return prompt, continuation

    def room(self, used: int, more: int, what: str, field: str | None = None) -> None:
        """`used` tokens and `more` (`what`) within the context; `field`: the one at fault."""
        if used + more > self.max_model_len:
            raise ContextOverflow(
                f"{used} tokens plus {what} ({more}) exceed the model's context of {self.max_model_len} tokens",
                field=field,
            )

    def top_k(self, k: int, field: str = "logprobs") -> None:
        if not isinstance(k, int) or k < 0 or k > self.max_logprobs:
            raise InvalidArgument(f"top logprobs must be an integer in 0..{self.max_logprobs}, got {k!r}", field=field)

    async def constraint(self, c: Constraint | None) -> None:
        """Validate a request's constraint in a worker thread (constraints.py), before `generate`:
        a large schema's parse then holds up no other stream. Refusals wait for `sampling_params`."""
        if c is not None and self.constraints is not None:
            await self.constraints.check(c)

    def sampling_params(self, o: SamplingOptions) -> SamplingParams:
        """vLLM's SamplingParams for `o` (streamed as deltas, not detokenized), every field checked."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        self.top_k(o.logprobs)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(o, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidArgument(f"{name} must be a finite number, got {value!r}", field=name)
        if o.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {o.temperature}", field="temperature")
        if not 0 < o.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {o.top_p}", field="top_p")
        # vLLM's own ranges, in its words: it names no parameter for these, and the field is core's to name.
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(o, name) <= 2.0:
                raise InvalidArgument(f"{name} must be in [-2, 2], got {float(getattr(o, name))}.", field=name)
        if o.repetition_penalty <= 0.0:
            raise InvalidArgument(
                f"repetition_penalty must be greater than zero, got {float(o.repetition_penalty)}.",
                field="repetition_penalty",
            )
        if not (o.temperature == 0 or o.top_k == 1) and not 0.0 <= o.min_p <= 1.0:  # greedy runs without min_p
            raise InvalidArgument(f"min_p must be in [0, 1], got {float(o.min_p)}.", field="min_p")
        if not isinstance(o.top_k, int) or o.top_k < 0:
            raise InvalidArgument(f"top_k must be a non-negative integer (0 = off), got {o.top_k!r}", field="top_k")
        if type(o.min_tokens) is not int or o.min_tokens < 0:
            raise InvalidArgument(
                f"min_tokens must be a non-negative integer, got {o.min_tokens!r}", field="min_tokens"
            )
        if o.min_tokens > o.max_tokens:  # vLLM's own words, which name no parameter
            raise InvalidArgument(
                f"min_tokens must be less than or equal to max_tokens={o.max_tokens}, got {o.min_tokens}.",
                field="min_tokens",
            )
        if o.seed is not None and (type(o.seed) is not int or not -(2**63) <= o.seed < 2**63):
            raise InvalidArgument(f"seed must be a 64-bit integer, got {o.seed!r}", field="seed")
        if type(o.priority) is not int or not -(2**31) <= o.priority < 2**31:
            raise InvalidArgument(f"priority must be a 32-bit integer, got {o.priority!r}", field="priority")
        stop = self.tokens("stop_token_ids", o.stop_token_ids)
        bias_ids = list(o.logit_bias)
        for token, bias in o.logit_bias.items():
            if type(token) is not int or not 0 <= token < self.vocab_size:  # keyed by token id: named by it
                raise InvalidArgument(
                    f"logit_bias[{token!r}]: {token!r} is not a token id of this model (0..{self.vocab_size - 1})",
                    field=f"logit_bias[{token}]",
                )
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise InvalidArgument(
                    f"logit_bias[{token}] must be a finite number, got {bias!r}", field=f"logit_bias[{token}]"
                )
        allowed = None
        if o.allowed_token_ids is not None:
            allowed = self.tokens("allowed_token_ids", o.allowed_token_ids)
            if not allowed:
                raise InvalidArgument(
                    "allowed_token_ids is empty: no token could be sampled", field="allowed_token_ids"
                )
        structured = None
        if o.structured_outputs is not None:
            if self.constraints is None:
                raise InvalidArgument(
                    f"{o.structured_outputs.source}: this engine has no structured outputs",
                    field=o.structured_outputs.source,
                )
            structured = self.constraints.params(o.structured_outputs)
        # top_k == 1 is greedy whatever the temperature; running it as greedy keeps
        # the reported logprobs informative (see engine.py's docstring).
        greedy = o.temperature == 0 or o.top_k == 1
        try:
            return SamplingParams(
                max_tokens=o.max_tokens,
                temperature=0.0 if greedy else float(o.temperature),
                top_p=1.0 if greedy else float(o.top_p),
                top_k=0 if greedy else o.top_k,
                min_p=0.0 if greedy else float(o.min_p),
                seed=o.seed,
                stop_token_ids=stop,
                logit_bias=dict(zip(bias_ids, map(float, o.logit_bias.values()), strict=True)) or None,
                allowed_token_ids=allowed,
                repetition_penalty=float(o.repetition_penalty),
                presence_penalty=float(o.presence_penalty),
                frequency_penalty=float(o.frequency_penalty),
                logprobs=o.logprobs,
                ignore_eos=o.ignore_eos,
                min_tokens=o.min_tokens,
                structured_outputs=structured,
                extra_args={RAW_LOGPROBS: True} if o.raw_logprobs else None,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM's own range checks, naming a parameter or not
            raise InvalidArgument(str(exc), field=getattr(exc, "parameter", None)) from None
