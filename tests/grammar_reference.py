"""The reference for constrained decoding: transformers' float32 greedy step, with the grammar's
token mask applied by xgrammar (the library vLLM's backend uses) at every step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tests.reference import Reference


class MaskedReference:
    """`greedy` under a JSON schema or a regex, as vLLM's xgrammar backend masks it."""

    def __init__(self, reference: Reference, model_dir: Path, vocab_size: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.reference = reference
        info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir), vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._vocab_size = info.vocab_size

    def greedy(self, prompt: Sequence[int], n: int, *, schema: str | None = None, regex: str | None = None):
        """Up to `n` (token, logprob) pairs: each step's argmax of the masked logits, and its
        log_softmax over the tokens the mask allows. Ends after the stop token the grammar ends on."""
        import xgrammar as xgr

        if schema is not None:
            grammar = self._compiler.compile_json_schema(schema, any_whitespace=True)
        else:
            grammar = self._compiler.compile_regex(regex)
        matcher = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, self._vocab_size)
        ids, out = list(prompt), []
        for _ in range(n):
            logits = self.reference.logits(ids)[-1:].float()
            matcher.fill_next_token_bitmask(mask)
            xgr.apply_token_bitmask_inplace(logits, mask)
            logprobs = torch.log_softmax(logits[0].double(), dim=-1)
            token = int(logprobs.argmax())
            out.append((token, float(logprobs[token])))
            ids.append(token)
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                break
        return out
