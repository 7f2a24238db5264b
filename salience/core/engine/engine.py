"""The inference engine: vLLM's AsyncLLM behind a small typed interface.

This is the only module that talks to vLLM's request API. It validates every
request before vLLM sees it (checks.py: a bad request raises a typed error and
never reaches the engine process), converts options to SamplingParams, and turns
vLLM's outputs into TokenEvents with absolute positions.

Logprobs: vLLM runs with logprobs_mode="processed_logprobs", so a generated
token's logprob and its top-k alternatives describe the distribution the token
was actually drawn from: log_softmax of the logits after logit_bias,
allowed_token_ids, the penalties, min_tokens and a constraint's mask, divided by
the temperature, with top-k / top-p / min-p truncation applied (truncated or
masked tokens have logprob -inf). Greedy decoding
reports that distribution at temperature 1 without truncation: the argmax of it
is the token chosen. LMQL's own server reports the biased distribution the same
way. Scored (prompt) tokens carry the model's plain log_softmax. A request with
`raw_logprobs` gets vLLM's `raw_logprobs` instead (logprobs_worker.py): the model's
distribution before all of that but a constraint's mask, as OpenAI and `vllm serve` report it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Unpack

from salience.core.engine.chat import ChatRenderer
from salience.core.engine.checks import RequestChecks
from salience.core.engine.constraints import ConstraintBackend
from salience.core.engine.detokenizer import TextStream
from salience.core.engine.fair_share import ANONYMOUS, FairShare, check_client
from salience.core.engine.generation import Generation
from salience.core.engine.images import Vision
from salience.core.engine.inflight import InFlight
from salience.core.engine.live import LiveConcepts
from salience.core.engine.passes import Passes, PassOptions, PrefillOptions
from salience.core.engine.preparation import Preparation
from salience.core.engine.prompt_scores import PromptScores
from salience.core.engine.prompts import PlacedImage
from salience.core.engine.requests import (
    NO_PROBES,
    Constraint,
    Probes,
    SamplingOptions,
    ScoredToken,
)
from salience.core.engine.row_budget import RowBudget
from salience.core.engine.rows import feature_plan, watched_features
from salience.core.engine.settings import EngineSettings
from salience.core.engine.start import startup
from salience.core.engine.token_meter import TokenMeter
from salience.core.features.served import ServedSAE
from salience.core.probes.calibration import Calibration, Presenter, ReadoutView
from salience.core.probes.concepts import ReadoutManifest
from salience.core.probes.live import ConceptView
from salience.core.probes.monitors import Monitor, MonitorState
from salience.core.probes.patching import PatchSites
from salience.core.probes.readouts import READ_TO_END, ReadoutHub, check_ranges, each_engine
from salience.core.probes.steering import Directions
from salience.errors import InvalidArgument, under

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = ["Engine"]

log = logging.getLogger(__name__)


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
        self.chat = ChatRenderer(
            self.tokenizer, settings.chat_template, vision=vision, tool_parser=settings.tool_call_parser
        )
        self.block_size: int = llm.vllm_config.cache_config.block_size  # the prefix cache's unit
        self.readouts: ReadoutHub | None = None
        self.steering: Directions | None = None  # what requests may steer along; None: no steering
        self.patching: PatchSites | None = None  # where requests may patch; None: nowhere (--patch-points)
        self.saes: list[ServedSAE] = []  # the sparse autoencoders the taps encode with (--sae)
        self.live = LiveConcepts(None, None, self._rpc, None)  # set up by start
        self.compiled = False  # set by start: whether vLLM runs the model compiled
        self.closed = False
        self.checks = RequestChecks(self.vocab_size, self.max_model_len, self.max_logprobs, ConstraintBackend(llm))
        self.inflight = InFlight(settings.data_parallel_size)
        self.fair_share: FairShare | None = None  # set by start: None with fair share off
        self.meter = TokenMeter()  # each client's generated tokens over the last minute
        row_bytes = 4 * self.hidden_size  # float32
        self.row_budget = RowBudget(max(1, settings.residual_memory_mib * 2**20 // row_bytes), row_bytes)
        self.preparation = Preparation(self)  # the steps every request takes (preparation.py)
        self.passes = Passes(self)  # scoring and reading passes (passes.py)

    def calibration(self, view: ConceptView | None = None) -> Calibration:
        """The calibration of `view` (by default the concepts a request starting now sees), or
        InvalidArgument saying why there is none."""
        view = view or self.live.view()
        if view is None:
            raise InvalidArgument(
                "probabilities and monitors need concept readouts, and this server has no concept set loaded"
            )
        return view.calibration

    def presenter(self, view: ConceptView | None, readout_view: ReadoutView) -> Presenter | None:
        """A new request's way of showing its readouts in `readout_view` (None: raw, as read); a view
        with no calibration to show it is the view's fault (field `readout_view`)."""
        if readout_view is ReadoutView.RAW:
            return None
        with under("readout_view"):
            return self.calibration(view).presenter(readout_view)

    @property
    def llm(self) -> AsyncLLM:
        """vLLM's engine, for the passes that submit to it (passes.py)."""
        return self._llm

    async def _rpc(self, method: str, args: tuple = ()) -> list:
        """collective_rpc on every data-parallel engine's workers."""
        return await each_engine(self._llm, self.settings.data_parallel_size, method, args)

    @classmethod
    async def start(cls, settings: EngineSettings) -> Engine:
        """Load the model and warm it up; only then is the engine ready to serve (start/startup.py)."""
        return await startup.start(cls, settings)

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
        running = self.inflight.generations()
        for generation in running:
            await generation.cancel()
        return len(running)

    # ---- what frontends ask besides requests: the facade, so none reaches into the parts ----------

    async def check_constraint(self, constraint: Constraint | None) -> None:
        """A request's constraint checked in a worker thread before `generate` (checks.constraint):
        a large schema's parse then holds up no other stream."""
        await self.checks.constraint(constraint)

    def check_tokens(self, what: str, ids: Sequence[int]) -> list[int]:
        """`ids` as a list, or InvalidArgument naming (field `what[i]`) the first outside the vocabulary."""
        return self.checks.tokens(what, ids)

    def concept_view(self) -> ConceptView | None:
        """The concepts a request starting now reads (None: no concept set)."""
        return self.live.view()

    @property
    def readout_manifest(self) -> ReadoutManifest | None:
        """What a readout row holds (None: no concept set, nothing to read out)."""
        return self.readouts.manifest if self.readouts is not None else None

    def steering_manifest(self) -> dict | None:
        """What clients are told of steering now: the directions (live ones included) and the
        limits (None: steering is off)."""
        return self.steering.manifest(self.live.directions()) if self.steering is not None else None

    # ---- requests --------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        options: SamplingOptions,
        *,
        probes: Probes = NO_PROBES,
        request_id: str | None = None,
        prompt_logprobs: int | None = None,
        logprobs_from: int = 1,
        images: Sequence[PlacedImage] = (),
        dp_rank: int | None = None,
        client: str = ANONYMOUS,
        weight: float = 1.0,
    ) -> Generation:
        """Start decoding after `prompt`; iterate the result for TokenEvents.

        With `prompt_logprobs` (top-k, 0 for the token's own only) the prompt
        positions from `logprobs_from` on are scored too, in the same pass:
        `Generation.prompt_scores()` has them once the first event is out. `images` sit in the prompt's vision
        blocks (expanded, as the client wrote them; see images.py). `probes` say what to read
        and steer (requests.Probes); the steering's `generated` positions are those after the
        prompt.

        `dp_rank` pins the request to one data-parallel engine (a session's); by default it goes
        to the least loaded one (`Generation.dp_rank` says which).

        The probes' monitors watch calibrated concept probabilities on every generated token
        (monitors.py); they read those tokens' readouts whether or not the readout ranges show
        them. Residual rows come on each covered event (TokenEvent.residual), the prompt's in
        `Generation.prompt_rows`; features likewise.

        The request reads the concepts served when it starts (live.ConceptView), whatever is
        defined or deleted while it runs; `Generation.concepts` names them.

        `client` and `weight` name whose request it is and that client's share weight: on a
        contended engine it reaches vLLM when fair share gives that client its turn (fair_share.py).

        Raises InvalidArgument or ContextOverflow before anything is submitted.
        Closing the Generation (or cancelling the task iterating it) aborts the
        request in vLLM.
        """
        check_client(client, weight)
        prompt = self.checks.tokens("prompt", prompt)
        if not prompt:
            raise InvalidArgument("prompt is empty: at least one token is needed to generate from", field="prompt")
        if not isinstance(options.max_tokens, int) or options.max_tokens < 1:
            raise InvalidArgument(
                f"max_tokens must be a positive integer, got {options.max_tokens!r}", field="max_tokens"
            )
        self.checks.room(len(prompt), options.max_tokens, "max_tokens", field="prompt")
        params = self.checks.sampling_params(options)
        if prompt_logprobs is not None:
            self.checks.top_k(prompt_logprobs)
            params.prompt_logprobs = prompt_logprobs
        scored_from = logprobs_from if prompt_logprobs is not None else None  # None: no prompt logprob wanted
        monitors, features = probes.monitors, probes.features
        hold = self.preparation.hold(probes.steer, len(prompt), probes.patch, len(prompt) + options.max_tokens)
        try:
            text = self._reply_text(monitors, options, prompt)
            with under("monitors"):
                calibration = self.calibration(hold.view) if any(m.feature is None for m in monitors) else None
            watch = MonitorState(monitors, calibration, self.saes, text)
            present = self.presenter(hold.view, probes.readout_view)
            with under("readout_ranges"):
                shown = check_ranges(probes.readout_ranges)
            read = [*shown, [len(prompt), READ_TO_END]] if watch.concepts else shown
            shown_features = None
            if watch.sae is not None:
                if features is not None:
                    feature_plan(features, self.saes)  # the client's own ask, checked
                features, shown_features = watched_features(features, watch.sae, len(prompt))
            plans = self.preparation.row_plans(probes.residual, features, len(prompt) + options.max_tokens)
            request_id, ranges, submitted = self.preparation.prepare(
                params, request_id, read, prompt, images, hold, dp_rank, plans, scored_from
            )
        except BaseException:
            hold.release()
            raise
        ticket = self.row_budget.reserve(sum(plan.held for plan in plans))
        slot = self.preparation.enter(client, weight, params, len(prompt), options.priority)
        rank = self.inflight.rank_of(request_id)
        # The last token's pass runs where the generation ran (its prefix is cached there), under
        # the generation's concepts and steering.
        last = Probes(readout_ranges=ranges, residual=probes.residual, features=features)
        read_last = functools.partial(
            self.passes.read_one, probes=last, images=images, hold=hold, request_id=f"{request_id}-last", dp_rank=rank
        )
        generation = Generation(
            self._llm,
            prompt,
            submitted,
            params,
            request_id,
            options.priority,
            self.readouts,
            ranges,
            read_last,
            dp_rank=rank,
            shown=shown,
            monitors=watch,
            readout_concepts=len(hold.view.concepts) if hold.view is not None else 0,
            present=present,
            rows=plans,
            shown_features=shown_features,
            ticket=ticket,
            slot=slot,
            logprobs_from=logprobs_from,
            meter=functools.partial(self.meter.add, client),
        )
        generation.concepts = hold.view
        self.inflight.running(request_id, generation)

        def ended() -> None:
            ticket.release()
            if slot is not None:
                slot.release()
            self.inflight.release(request_id)
            hold.release()

        generation.on_end = ended
        return generation

    async def score(
        self, prompt: Sequence[int], continuation: Sequence[int], **options: Unpack[PassOptions]
    ) -> list[ScoredToken]:
        """Each continuation token's logprob (Passes.score)."""
        return await self.passes.score(prompt, continuation, **options)

    async def score_pass(
        self, prompt: Sequence[int], continuation: Sequence[int], **options: Unpack[PassOptions]
    ) -> PromptScores | None:
        """The whole pass of a score (Passes.score_pass)."""
        return await self.passes.score_pass(prompt, continuation, **options)

    async def prefill(self, tokens: Sequence[int], **options: Unpack[PrefillOptions]) -> PromptScores:
        """One pass over `tokens` (Passes.prefill)."""
        return await self.passes.prefill(tokens, **options)

    async def readout(self, tokens: Sequence[int], ranges: Sequence[tuple[int, int]]) -> dict[int, tuple[float, ...]]:
        """Readouts of `tokens` where `ranges` cover (Passes.readout)."""
        return await self.passes.readout(tokens, ranges)

    def _reply_text(
        self, monitors: Sequence[Monitor], options: SamplingOptions, prompt: Sequence[int]
    ) -> Callable[[int], str] | None:
        """Each generated token's text, for monitors that watch a field of a JSON reply (None if none does)."""
        scoped = next((i for i, m in enumerate(monitors) if m.path is not None), None)
        if scoped is None:
            return None
        constraint = options.structured_outputs
        if constraint is None or constraint.kind not in ("json", "json_object"):
            raise InvalidArgument(
                f"monitors[{scoped}].path watches a field of a JSON reply: ask for one "
                "(response_format json_schema or json_object; structured_outputs json or json_object)",
                field=f"monitors[{scoped}].path",
            )
        return TextStream(self.tokenizer, prompt, skip_special_tokens=True).push


@functools.cache
def _finalized(cls: type) -> type:
    """`cls` without its finalizer, for an engine already shut down."""
    return type(f"Finalized{cls.__name__}", (cls,), {"__del__": lambda self: None})
