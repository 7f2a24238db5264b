"""The salience.ext.v1.SalienceExtensions servicer: Salience's additions to the seed's service."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from salience.core.engine.constraints import KINDS, parse_constraint
from salience.core.engine.images import Vision
from salience.core.engine.requests import Constraint, FeatureRequest, Probes, ResidualRequest
from salience.core.models.points import POINTS
from salience.core.probes.calibration import ReadoutView, calibrated
from salience.core.probes.monitors import Action, Monitor, MonitorEvent, parse_monitors
from salience.core.probes.patching import Patch
from salience.core.probes.steering import Intervention, Op
from salience.core.probes.steering import manifest as steering_manifest
from salience.core.serving import live_concepts
from salience.core.serving.conversations import ChatTurn
from salience.core.serving.live_concepts import ConceptDefinition
from salience.core.serving.patch_sweep import Sweep, SweepGrid, sweep
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.core.serving.turns import SessionToken, Turn, TurnDone
from salience.errors import InvalidArgument, under
from salience.grpc_frontend.auth import CLIENT
from salience.grpc_frontend.chat import chat_message, chat_messages, run_chat
from salience.grpc_frontend.service import SEED_FIELDS, run_turn, seed_event, turn_from
from salience.grpc_frontend.status_codes import translating, translating_stream
from salience.logs import REQUEST_ID
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb

__all__ = ["ExtensionsService"]

_OPS = {
    ext.Intervention.OP_ADD: Op.ADD,
    ext.Intervention.OP_SET: Op.SET,
    ext.Intervention.OP_ABLATE: Op.ABLATE,
    ext.Intervention.OP_CAP: Op.CAP,
}
_ACTIONS = {ext.Monitor.ACTION_FLAG: "flag", ext.Monitor.ACTION_STOP: "stop"}
_INFO_FIELDS = (
    "name",
    "recommended_layer",
    "method",
    "n_fit",
    "n_heldout",
    "validation",
    "n_positive",
    "n_negative",
    "n_pairs",
    "n_background",
    "warning",
)
_FIT_FIELDS = tuple(ext.LayerFit.DESCRIPTOR.fields_by_name)
_VIEWS = {
    ext.ExtendedGenerateRequest.READOUT_FORMAT_RAW: ReadoutView.RAW,
    ext.ExtendedGenerateRequest.READOUT_FORMAT_TOKEN: ReadoutView.TOKEN,
    ext.ExtendedGenerateRequest.READOUT_FORMAT_RUNNING: ReadoutView.RUNNING,
}


# Core's names for the fields of an ExtendedGenerateRequest (and a SteeredGenerateRequest), as
# gRPC names them in an error's field: the seed request's own under `generate`.
EXTENDED_FIELDS = {
    **{name: f"generate.{name}" for name in pb.GenerateRequest.DESCRIPTOR.fields_by_name},
    **{name: f"generate.{wire}" for name, wire in SEED_FIELDS.items()},
    "steer": "interventions",
    "readout_view": "readout_format",
}
# ... and of a ChatGenerateRequest: the turn's under `turn`, beside its messages.
CHAT_FIELDS = {
    **{name: f"turn.{name}" for name in ext.ExtendedGenerateRequest.DESCRIPTOR.fields_by_name},
    **{name: f"turn.{wire}" for name, wire in EXTENDED_FIELDS.items()},
}


class ExtensionsService(extensions_pb2_grpc.SalienceExtensionsServicer):
    def __init__(self, status: ServerStatus, sessions: SessionStore) -> None:
        self._status = status
        self._sessions = sessions

    @translating_stream
    async def SteeredGenerate(
        self, request: ext.SteeredGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        with under(names=EXTENDED_FIELDS):
            turn = turn_from(request.generate, REQUEST_ID.get(), Probes(steer=interventions(request.interventions)))
            async with contextlib.aclosing(
                run_turn(self._status, self._sessions, request.generate.session_id, turn)
            ) as items:
                async for item in items:
                    yield seed_event(item)

    @translating_stream
    async def ExtendedGenerate(
        self, request: ext.ExtendedGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext.ExtendedGenerateEvent]:
        with under(names=EXTENDED_FIELDS):
            turn = extended_turn(request)
            async with contextlib.aclosing(
                run_turn(self._status, self._sessions, request.generate.session_id, turn)
            ) as items:
                async for item in items:
                    yield extended_event(item)

    @translating_stream
    async def ChatGenerate(
        self, request: ext.ChatGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext.ChatGenerateEvent]:
        with under(names=CHAT_FIELDS):
            messages, turn = chat_messages(request.messages), extended_turn(request.turn)
            chat: ChatTurn | None = None
            async with contextlib.aclosing(
                run_chat(self._status, self._sessions, request.turn.generate.session_id, messages, turn)
            ) as items:
                async for item in items:
                    if isinstance(item, ChatTurn):
                        chat = item
                        appended = ext.ChatAppended(offset=chat.appended.offset, tokens=chat.appended.tokens)
                        yield ext.ChatGenerateEvent(appended=appended)
                        continue
                    event = ext.ChatGenerateEvent(event=extended_event(item))
                    if isinstance(item, TurnDone):
                        assert chat is not None and chat.reply is not None  # announced first; replied as the run ended
                        event.reply.CopyFrom(chat_message(chat.reply))
                    yield event

    @translating_stream
    async def PatchSweep(
        self, request: ext.PatchSweepRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext.PatchSweepEvent]:
        asked = Sweep(
            clean=tuple(request.clean),
            corrupted=tuple(request.corrupted),
            answer=tuple(request.answer),
            foil=tuple(request.foil),
            points=tuple(request.points) or ("resid_pre",),
            layers=tuple(request.layers),
            positions=tuple(request.positions),
            metric=request.metric or "logprob",
        )
        client = CLIENT.get()
        told: asyncio.Queue[tuple[int, int] | None] = asyncio.Queue()  # progress, then None at the end
        with self._status.admit("grpc", "patch_sweep", **client.admission()) as admitted:
            running = asyncio.ensure_future(
                sweep(
                    admitted.engine,
                    asked,
                    progress=lambda done, total: told.put_nowait((done, total)),
                    client=client.share,
                    weight=client.weight,
                )
            )
            running.add_done_callback(lambda _: told.put_nowait(None))
            try:
                while (progress := await told.get()) is not None:
                    done, total = progress
                    yield ext.PatchSweepEvent(progress=ext.PatchSweepEvent.Progress(done=done, total=total))
                grid = running.result()
            finally:
                running.cancel()
        yield ext.PatchSweepEvent(grid=sweep_grid(grid))

    @translating
    async def GetConceptManifest(self, request: ext.GetConceptManifestRequest, context: grpc.aio.ServicerContext):
        view = self._status.serving_engine().concept_view()
        manifest = ext.ConceptManifest()
        if view is not None:
            manifest.version, manifest.point = view.version, view.point
            for name, info in zip(view.concepts, view.info, strict=True):
                concept = manifest.concepts.add(name=name, live=name in view.live)
                if calibrated(info):
                    concept.info.CopyFrom(_concept_info(info))
        return manifest

    @translating
    async def GetSAEManifest(self, request: ext.GetSAEManifestRequest, context: grpc.aio.ServicerContext):
        fields = ext.SAEInfo.DESCRIPTOR.fields_by_name
        saes = [
            ext.SAEInfo(
                **{key: value or 0 if key == "k" else value for key, value in served.info.items() if key in fields}
            )
            for served in self._status.serving_engine().saes
        ]
        return ext.SAEManifest(saes=saes)

    @translating
    async def DefineConcept(self, request: ext.DefineConceptRequest, context: grpc.aio.ServicerContext):
        definition = ConceptDefinition(
            name=request.name,
            positive=tuple(request.positive),
            negative=tuple(request.negative),
            method=request.method or "auto",
            layers=tuple(request.layers) or None,
            vector=request.vector or None,
            vectors=dict(request.vectors) or None,
        )
        reply = await live_concepts.define(self._status, definition, frontend="grpc")
        response = ext.DefineConceptResponse(
            name=reply["concept"], manifest_version=reply["version"], table=reply["table"]
        )
        info = reply["concept_info"]
        if calibrated(info):
            response.info.CopyFrom(_concept_info(info))
        return response

    @translating
    async def DeleteConcept(self, request: ext.DeleteConceptRequest, context: grpc.aio.ServicerContext):
        reply = await live_concepts.delete(self._status, request.name)
        return ext.DeleteConceptResponse(manifest_version=reply["version"])

    @translating
    async def SaveConcepts(self, request: ext.SaveConceptsRequest, context: grpc.aio.ServicerContext):
        data = live_concepts.save(self._status)
        view = self._status.serving_engine().concept_view()
        return ext.SaveConceptsResponse(concept_set=data, concepts=view.concepts if view else ())

    @translating
    async def GetSteeringManifest(self, request: ext.GetSteeringManifestRequest, context: grpc.aio.ServicerContext):
        # Steering off: no direction, and the limits any steering request would be held to.
        described = self._status.serving_engine().steering_manifest() or steering_manifest({}, 0)
        return ext.SteeringManifest(
            max_interventions=described["max_interventions"],
            max_magnitude=described["max_magnitude"],
            vector_columns=described["vector_columns"],
            directions=[
                ext.SteeringManifest.Direction(name=name, layers=layers)
                for name, layers in described["directions"].items()
            ],
        )

    @translating
    async def ImageInfo(self, request: ext.ImageInfoRequest, context: grpc.aio.ServicerContext):
        engine = self._status.serving_engine()
        vision = Vision.of(engine.vision, engine.model_name)
        facts = await asyncio.to_thread(vision.inspect, request.bytes, request.mime)
        t, h, w = facts.grid
        width, height = facts.size
        return ext.ImageInfoResponse(
            pad_tokens=facts.pads,
            block_tokens=facts.pads + 2,
            grid_t=t,
            grid_h=h,
            grid_w=w,
            vision_start_token_id=vision.start,
            image_pad_token_id=vision.pad,
            vision_end_token_id=vision.end,
            width=width,
            height=height,
        )


def extended_turn(request: ext.ExtendedGenerateRequest) -> Turn:
    """The core Turn an ExtendedGenerateRequest asks for."""
    residual = None
    if request.HasField("residual"):
        point = request.residual.point or None
        if point is not None and point not in POINTS:
            raise InvalidArgument(
                f"residual.point must be one of {', '.join(POINTS)}, got {point!r}", field="residual.point"
            )
        residual = ResidualRequest(
            layers=tuple(request.residual.layers),
            ranges=tuple((r.start, r.end) for r in request.residual.ranges),
            point=point,
        )
    features = None
    if request.HasField("features"):
        features = FeatureRequest(
            sae=request.features.sae or None,
            k=request.features.k,
            ranges=tuple((r.start, r.end) for r in request.features.ranges),
        )
    view = _VIEWS.get(request.readout_format)
    if view is None:
        raise InvalidArgument(f"readout_format {request.readout_format} is not a ReadoutFormat", field="readout_format")
    probes = Probes(
        readout_view=view,
        steer=interventions(request.interventions),
        monitors=monitors(request.monitors),
        residual=residual,
        features=features,
        patch=patches(request.patches),
    )
    constraint = structured_outputs(request.constraint) if request.HasField("constraint") else None
    return turn_from(request.generate, REQUEST_ID.get(), probes, constraint)


def patches(messages) -> tuple[Patch, ...]:
    """Core patches from their protobuf form; the engine checks points, layers, positions and rows."""
    out = []
    for n, m in enumerate(messages):
        if m.point not in POINTS:
            raise InvalidArgument(
                f"patches[{n}]: point must be one of {', '.join(POINTS)}, got {m.point!r}", field=f"patch[{n}].point"
            )
        out.append(Patch(point=m.point, layer=m.layer, positions=tuple(m.positions), rows=m.rows))
    return tuple(out)


def sweep_grid(grid: SweepGrid) -> ext.SweepGrid:
    return ext.SweepGrid(
        metric=grid.metric,
        points=grid.points,
        layers=grid.layers,
        positions=grid.positions,
        clean=grid.clean,
        corrupted=grid.corrupted,
        grids=[
            ext.SweepGrid.PointGrid(point=point, values=[v for row in grid.values[point] for v in row])
            for point in grid.points
        ],
    )


def structured_outputs(message: ext.Constraint) -> Constraint:
    """A core Constraint from its protobuf form, through the one reader LMTP's and the OpenAI API's
    JSON form use: its set members as vLLM's `structured_outputs` object (errors name `constraint.json`, ...)."""
    given = {kind: getattr(message, kind) for kind in KINDS if message.HasField(kind)}
    if "choice" in given:
        given["choice"] = list(message.choice.texts)
    return parse_constraint(given, "constraint")


def extended_event(item: SessionToken | TurnDone) -> ext.ExtendedGenerateEvent:
    """A turn's token or end as ExtendedGenerate streams it: the seed's event, and beside it the
    monitors that fired, residual rows and features at a token, the stopping monitor at the end."""
    event = ext.ExtendedGenerateEvent(event=seed_event(item))
    if isinstance(item, SessionToken):
        event.monitors.extend(_monitor_event(m) for m in item.monitors)
        if item.residual is not None:
            event.residual = item.residual.astype("<f4", copy=False).tobytes()
        if item.features is not None:
            event.features.extend(ext.FeatureActivation(id=i, activation=a) for i, a in item.features)
    elif item.stopped_by is not None:
        event.stopped_by.CopyFrom(_monitor_event(item.stopped_by))
    return event


def _concept_info(info: dict) -> ext.ConceptInfo:
    """The manifest's concept_info as protobuf: the names the issue fixed are always there, the
    rest where the builder wrote them."""
    writes = info.get("writes") or {}
    return ext.ConceptInfo(
        **{field: info[field] for field in _INFO_FIELDS if field in info},
        layers=[_layer_fit(fit) for fit in info["layers"]],
        writes_layer=writes.get("layer", 0),
        raises=writes.get("raises", ()),
        lowers=writes.get("lowers", ()),
    )


def _layer_fit(fit: dict) -> ext.LayerFit:
    """One layer's figures; an interval [low, high] as its two fields."""
    bounds = {
        f"{name}_{end}": value
        for name in ("auroc", "accuracy", "background_fpr")
        for end, value in zip(("low", "high"), fit.get(f"{name}_interval") or (), strict=False)
    }
    return ext.LayerFit(**{f: fit[f] for f in _FIT_FIELDS if f in fit}, **bounds)


def monitors(messages) -> tuple[Monitor, ...]:
    """Core monitors from their protobuf form, through the one parser LMTP's JSON form uses."""
    return parse_monitors(
        [
            {
                **({"feature": m.feature.id, "sae": m.feature.sae or None} if m.HasField("feature") else {}),
                **({"concept": m.concept} if m.concept or not m.HasField("feature") else {}),
                "action": _ACTIONS.get(m.action),
                **{field: getattr(m, field) for field in ("layer", "above", "below", "path") if m.HasField(field)},
            }
            for m in messages
        ]
    )


def _monitor_event(event: MonitorEvent) -> ext.MonitorEvent:
    message = ext.MonitorEvent(
        monitor=event.monitor,
        concept=event.concept,
        layer=event.layer,
        position=event.position,
        probability=event.probability,
        action=ext.Monitor.ACTION_STOP if event.action is Action.STOP else ext.Monitor.ACTION_FLAG,
    )
    if event.feature is not None:
        message.feature.CopyFrom(ext.FeatureRef(sae=event.sae or "", id=event.feature))
    if event.path is not None:
        message.path = event.path
    return message


def interventions(messages) -> tuple[Intervention, ...]:
    """Core interventions from their protobuf form; the engine checks their count, names, layers
    and values."""
    out = []
    for n, m in enumerate(messages):
        if m.op not in _OPS:
            raise InvalidArgument(f"steer[{n}]: op must be OP_ADD, OP_SET, OP_ABLATE or OP_CAP", field=f"steer[{n}].op")
        out.append(
            Intervention(
                direction=m.direction,
                vector=m.vector or None,
                feature=(m.feature.sae, m.feature.id) if m.HasField("feature") else None,
                layers=tuple(m.layers),
                op=_OPS[m.op],
                value=m.value,
                lo=m.lo if m.HasField("lo") else None,
                hi=m.hi if m.HasField("hi") else None,
                prompt=m.prompt,
                ranges=tuple((r.start, r.end) for r in m.ranges),
                generated=m.generated,
            )
        )
    return tuple(out)
