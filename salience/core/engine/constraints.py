"""Structured-output constraints: one reader for every frontend, one check against vLLM's backend.

`parse_constraint` reads vLLM's `structured_outputs` object (exactly one of `json`, `regex`,
`choice`, `grammar`, `json_object`), as LMTP and the OpenAI API both take it; `constraint` reads
one kind's value, for a frontend with a spelling of its own (OpenAI's `response_format`). They
check shape and size, and need no vLLM (the LMTP codec, which the client install imports, uses
them).

Whether the backend can compile a constraint is `ConstraintBackend.params`, which the engine runs
before vLLM sees the request: vLLM's own validation (`SamplingParams.verify`: xgrammar, falling
back to guidance, then outlines, as vLLM chooses), on a probe holding the constraint alone, so
that what it refuses is the constraint. Left to vLLM's input processor, a refusal would come as
the request's failure once a response had started.

That validation parses the grammar (a large schema takes a while), so frontends run it ahead,
in a worker thread (`ConstraintBackend.check`, awaited through `RequestChecks.constraint`): the
event loop that serves every other stream never waits on it. Its verdicts, refusals included,
are kept for the last `CHECKED` constraints, so `params`, on the loop, only looks one up. vLLM
validates again when the request is added, in its input processor's thread pool; compiling
against the vocabulary is the engine core's, in its own thread pool, while other requests
decode, and xgrammar keeps compiled grammars up to `VLLM_XGRAMMAR_CACHE_MB` (512 MB by default).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, get_args

from salience.core.engine.requests import Constraint, ConstraintKind
from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["CHECKED", "KINDS", "MAX_SPEC_CHARS", "ConstraintBackend", "constraint", "parse_constraint"]

KINDS: tuple[ConstraintKind, ...] = get_args(ConstraintKind)
# A schema's JSON text, a regex, a grammar, or the choices together: past this a constraint is
# refused, since vLLM parses it twice and compiles it before the request runs.
MAX_SPEC_CHARS = 65_536
# How many constraints' verdicts ConstraintBackend keeps (each at most MAX_SPEC_CHARS of text).
CHECKED = 256
# vLLM's other options in the same object: accepted at their neutral value only.
_NEUTRAL = {
    "disable_any_whitespace": False,
    "disable_additional_properties": False,
    "whitespace_pattern": None,
    "structural_tag": None,
}


def parse_constraint(value: Any, name: str = "structured_outputs") -> Constraint:
    """vLLM's `structured_outputs` object as a Constraint; null members count as absent."""
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be an object holding one of {', '.join(KINDS)}", field=name)
    for key, option in value.items():
        if key in KINDS:
            continue
        if key not in _NEUTRAL:
            raise InvalidArgument(
                f"{name}.{key} is not a constraint; {name} holds one of {', '.join(KINDS)}", field=f"{name}.{key}"
            )
        if option is not None and option != _NEUTRAL[key]:
            raise InvalidArgument(f"{name}.{key} is not supported by this server", field=f"{name}.{key}")
    given = [kind for kind in KINDS if value.get(kind) is not None]
    if len(given) != 1:
        found = f"got {' and '.join(given)}" if given else "got none"
        raise InvalidArgument(f"{name} must hold exactly one of {', '.join(KINDS)}; {found}", field=name)
    kind = given[0]
    return constraint(kind, value[kind], f"{name}.{kind}")


def constraint(kind: ConstraintKind, value: Any, name: str) -> Constraint:
    """One kind's value (`name`: the request field it is in): a JSON schema (an object, or its
    JSON text), a regex, a non-empty list of texts, a grammar, or `true` for any JSON object."""
    if kind == "json":
        spec: str | tuple[str, ...] | None = _schema(value, name)
    elif kind == "json_object":
        if value is not True:
            raise InvalidArgument(f"{name} must be true (leave it out for no constraint)", field=name)
        spec = None
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidArgument(f"{name} must be a non-empty list of strings", field=name)
        spec = tuple(value)
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or (kind == "grammar" and not value.strip()):
            raise InvalidArgument(f"{name} must be a {'non-empty ' if kind == 'grammar' else ''}string", field=name)
        spec = value
    else:
        raise InvalidArgument(f"{name}: unknown constraint kind {kind!r}", field=name)
    size = sum(map(len, spec)) if isinstance(spec, tuple) else len(spec or "")
    if size > MAX_SPEC_CHARS:
        raise InvalidArgument(f"{name} is {size} characters long; at most {MAX_SPEC_CHARS} are allowed", field=name)
    return Constraint(kind=kind, spec=spec, source=name)


def _schema(value: Any, name: str) -> str:
    """A JSON schema's compact JSON text (its properties in the order given: the order the output
    writes them in)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidArgument(f"{name} is not valid JSON: {exc}", field=name) from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be a JSON schema (an object)", field=name)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ConstraintBackend:
    """The engine's structured-output backend, as vLLM was started with it (backend `auto`)."""

    def __init__(self, llm: AsyncLLM) -> None:
        config = llm.vllm_config
        self._verify_with = (llm.model_config, config.speculative_config, config.structured_outputs_config)
        self._tokenizer = llm.get_tokenizer()
        # (kind, spec) -> vLLM's params as it checked them, or why it refused; least recent first.
        self._checked: OrderedDict[tuple, StructuredOutputsParams | str] = OrderedDict()

    async def check(self, c: Constraint) -> None:
        """Validate `c` in a worker thread, unless its verdict is kept; `params` then finds it."""
        key = (c.kind, c.spec)
        if key not in self._checked:
            self._keep(key, await asyncio.to_thread(self._verify, c))

    def params(self, c: Constraint) -> StructuredOutputsParams:
        """vLLM's StructuredOutputsParams for `c`, checked as vLLM will check it, with its backend
        chosen; InvalidArgument naming `c.source` if no backend takes it. Validates here, on the
        caller's thread, only what `check` has not."""
        key = (c.kind, c.spec)
        verdict = self._checked.get(key)
        if verdict is None:
            verdict = self._verify(c)
        self._keep(key, verdict)
        if isinstance(verdict, str):
            raise InvalidArgument(f"{c.source}: {verdict}", field=c.source)
        return copy.deepcopy(verdict)  # vLLM's own validation writes into the request's copy

    def _keep(self, key: tuple, verdict: StructuredOutputsParams | str) -> None:
        self._checked[key] = verdict
        self._checked.move_to_end(key)
        while len(self._checked) > CHECKED:
            self._checked.popitem(last=False)

    def _verify(self, c: Constraint) -> StructuredOutputsParams | str:
        """vLLM's validation of `c` alone: the params it checked, or its reason for refusing."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import StructuredOutputsParams

        value = True if c.kind == "json_object" else list(c.spec) if isinstance(c.spec, tuple) else c.spec
        params = StructuredOutputsParams(**{c.kind: value})
        try:
            SamplingParams(max_tokens=1, structured_outputs=params).verify(*self._verify_with, self._tokenizer)
        except (ValueError, VLLMClientError) as exc:
            return _one_line(exc)
        return params


def _one_line(exc: Exception, limit: int = 500) -> str:
    """The backend's message on one line (a regex error draws a caret under its pattern)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
