"""The steps every request takes before vLLM sees it, whether it decodes (Engine.generate) or
runs one pass (passes.py): its concepts and steering held, its residual rows and features
checked, its id claimed and routed, its hooks tagged, its prompt built, its fair-share turn.

They read parts the engine gets only as it starts (the concepts, steering, SAEs, fair share), so
they take the engine (its `Parts`) and read them when a request comes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from salience.core.engine.feature_steering import resolve_features
from salience.core.engine.newcomer_scheduler import NEWCOMER
from salience.core.engine.prompts import submission
from salience.core.engine.rows import feature_plan, residual_plan
from salience.core.models.points import Site
from salience.core.probes.patch_worker import TAG as PATCH_TAG
from salience.core.probes.patching import NO_PATCHES, ResolvedPatches, patch_salt
from salience.core.probes.readout_worker import TAG
from salience.core.probes.readouts import check_ranges
from salience.core.probes.steering import ResolvedSteer
from salience.core.probes.steering_worker import TAG as STEER_TAG
from salience.errors import InvalidArgument, under

if TYPE_CHECKING:
    from vllm import SamplingParams

    from salience.core.engine.fair_share import FairShare, Slot
    from salience.core.engine.images import Vision
    from salience.core.engine.inflight import InFlight
    from salience.core.engine.live import Hold, LiveConcepts
    from salience.core.engine.prompts import PlacedImage
    from salience.core.engine.requests import FeatureRequest, ResidualRequest
    from salience.core.engine.row_budget import RowBudget
    from salience.core.engine.rows import RowPlan
    from salience.core.engine.settings import EngineSettings
    from salience.core.features.served import ServedSAE
    from salience.core.models.points import Point
    from salience.core.probes.live import ConceptView
    from salience.core.probes.patching import Patch, PatchSites
    from salience.core.probes.readouts import ReadoutHub
    from salience.core.probes.steering import Directions, Intervention

__all__ = ["Parts", "Preparation"]


class Parts(Protocol):
    """What preparing a request reads of its engine (engine.Engine)."""

    settings: EngineSettings
    model_name: str
    hidden_size: int
    block_size: int
    vision: Vision | None
    inflight: InFlight
    row_budget: RowBudget
    # Set as the engine starts (start/startup.py):
    live: LiveConcepts
    saes: list[ServedSAE]
    steering: Directions | None
    patching: PatchSites | None
    readouts: ReadoutHub | None
    fair_share: FairShare | None


class Preparation:
    """One engine's request preparation (Engine.preparation)."""

    def __init__(self, engine: Parts) -> None:
        self._engine = engine

    def enter(
        self, client: str, weight: float, params: SamplingParams, prompt_tokens: int, priority: int = 0
    ) -> Slot | None:
        """The request's place in the fair-share admission (None with fair share off); a newcomer's
        `params` say so to the engine core's scheduler (newcomer_scheduler.py)."""
        engine = self._engine
        if engine.fair_share is None:
            return None
        slot = engine.fair_share.enter(client, weight, prompt_tokens, priority)
        if slot.newcomer:
            _tag(params, NEWCOMER, True)
        return slot

    def hold(
        self, steer: Sequence[Intervention], prompt_len: int, patch: Sequence[Patch] = (), end: int | None = None
    ) -> Hold:
        """The concepts a request starting now sees, its interventions checked against them, and its
        patches checked against positions below `end` (default: the prompt's)."""
        patches = self.resolve_patches(patch, prompt_len if end is None else end)
        return self._engine.live.hold(self.resolve_steer(steer, prompt_len), patches)

    def resolve_patches(self, patch: Sequence[Patch], end: int) -> ResolvedPatches:
        """The patches checked against the sites this server patches (patching.PatchSites.resolve)."""
        if not patch:
            return NO_PATCHES
        if self._engine.patching is None:
            raise InvalidArgument(
                "patching was asked for, but this server patches nowhere (start it with --patch-points)", field="patch"
            )
        return self._engine.patching.resolve(patch, end)

    def prepare(
        self,
        params: SamplingParams,
        request_id: str | None,
        readout_ranges: Sequence[tuple[int, int]],
        tokens: list[int],
        images: Sequence[PlacedImage],
        hold: Hold,
        dp_rank: int | None = None,
        plans: Sequence[RowPlan] = (),
        logprobs_from: int | None = None,
    ) -> tuple[str, list[list[int]], object]:
        """Claim the request id, route it to a DP rank, tag the readouts and the steering and build
        vLLM's prompt; the id is released if any fails. `logprobs_from`: the first prompt position
        whose logprob is wanted (None: none is)."""
        engine = self._engine
        key = engine.inflight.claim(request_id)
        try:
            engine.inflight.route(key, dp_rank)
            ranges = self._ask_readouts(params, key, readout_ranges, hold.view)
            for plan in plans:
                _tag(params, plan.tag, plan.tag_value(key))
            # A position's readout and rows come from its own hidden state, its logprob from the one before.
            needed = [start for start, _ in ranges] + [start for plan in plans for start, _ in plan.ranges]
            if logprobs_from is not None:
                needed.append(logprobs_from - 1)
            params.skip_reading_prefix_cache = not self.cache_serves_none_of(
                min(needed, default=len(tokens)), len(tokens)
            )
            submitted = submission(engine.vision, engine.model_name, tokens, images)
            steering, patches = hold.steer, hold.patch
            if steering:
                _tag(params, STEER_TAG, steering.payload())
            if patches:
                _tag(params, PATCH_TAG, patches.payload())
            # KV computed under these interventions and patches is found only by requests stating the same.
            salt = patch_salt(steering.cache_salt(), patches.cache_salt())
            if salt is not None:
                submitted["cache_salt"] = salt
            return key, ranges, submitted
        except BaseException:
            engine.inflight.release(key)
            raise

    def resolve_steer(self, steer: Sequence[Intervention], prompt_len: int) -> ResolvedSteer:
        """The interventions checked against the concepts served now and made absolute
        (steering.Directions.resolve)."""
        engine = self._engine
        if not steer:
            return ResolvedSteer(())
        steer = resolve_features(steer, engine.saes)
        if engine.steering is None:
            raise InvalidArgument(
                "steering was asked for, but this server has nothing to steer along (no concept or steering set, "
                "or steering is off)"
            )
        return engine.steering.resolve(steer, prompt_len, engine.live.directions())

    def row_plans(self, residual: ResidualRequest | None, features: FeatureRequest | None, end: int) -> list[RowPlan]:
        """A request's residual rows and features checked, with `end` the first position it cannot
        reach; empty when it asks for neither."""
        engine = self._engine
        plans = []
        if residual is None and features is None:
            return plans
        if engine.readouts is None or engine.settings.pipeline_parallel_size > 1:
            raise InvalidArgument(
                "residual rows and features need concept readouts (a concept set) on one pipeline stage"
            )
        if residual is not None:
            read, slots = self._residual_sites(residual.point)
            limit = engine.settings.max_residual_rows
            plan = residual_plan(residual, end, read=read, slots=slots, hidden=engine.hidden_size, limit=limit)
            engine.row_budget.check(plan.held, f"{plan.held // plan.layers} positions x {plan.layers} layers")
            plans.append(plan)
        if features is not None:
            plans.append(feature_plan(features, engine.saes))
        return plans

    def _residual_sites(self, point: Point | None) -> tuple[Sequence[int], Sequence[int]]:
        """The layers residual rows at `point` come from, and their capture slots: the patch taps'
        at a patch point (every layer), else the readout taps' at the readouts' point (the read
        layers; None is that point). Both read the stream after steering and patches."""
        engine = self._engine
        loaded, patching = engine.readouts.table.loaded, engine.patching
        patched = patching.points if patching is not None else ()
        if point is not None and point in patched:
            layers = range(patching.num_layers)
            return layers, [patching.capture_slot(Site(layer, point)) for layer in layers]
        if point is None or point == loaded.point:
            return loaded.layers, range(len(loaded.layers))
        served = ", ".join(dict.fromkeys((loaded.point, *patched)))
        raise InvalidArgument(
            f"residual rows at {point} were asked for; this server reads them at {served} (--patch-points adds points)",
            field="residual.point",
        )

    def cache_serves_none_of(self, first: int, length: int) -> bool:
        """Whether vLLM's prefix cache cannot serve position `first` of a `length`-token prompt, so
        that a pass may read the cache and still compute every position from `first` on.

        Positions served from the cache are never computed: no readout, no rows, no logprob of the
        next token. The cache serves whole blocks and never the last prompt position, so at most
        the first ((length - 1) // block_size) * block_size positions. A pass wanting only
        positions past that (a session's new tokens, a SCORE's continuation) reads the cache and
        computes the rest; one wanting an earlier position reads none of it (exact either way)."""
        block = self._engine.block_size
        return first >= (length - 1) // block * block

    def _ask_readouts(
        self, params: SamplingParams, key: str, ranges: Sequence[tuple[int, int]], view: ConceptView | None
    ) -> list[list[int]]:
        """Tag the request for the worker's hooks (whether it may read the prefix cache: prepare)."""
        engine = self._engine
        if not ranges:
            return []
        if engine.readouts is None or view is None:
            raise InvalidArgument(
                "readouts were asked for, but the server has no concept set loaded", field="readout_ranges"
            )
        with under("readout_ranges"):
            checked = check_ranges(ranges)
        _tag(params, TAG, [key, checked, list(view.columns)])
        return checked


def _tag(params: SamplingParams, name: str, value: object) -> None:
    """Tell vLLM's worker hooks and scheduler about the request, in the `extra_args` they read."""
    params.extra_args = {**(params.extra_args or {}), name: value}
