"""The salience.ext.v1.SalienceExtensions servicer: Salience's additions to the seed's service."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from salience.core.engine.images import Vision
from salience.core.probes.steering import MAX_INTERVENTIONS, MAX_MAGNITUDE, Intervention, Op
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.errors import InvalidArgument
from salience.grpc_frontend.service import run_turn, turn_from
from salience.grpc_frontend.status_codes import translating, translating_stream
from salience.logs import REQUEST_ID
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb

__all__ = ["ExtensionsService"]

_OPS = {ext.Intervention.OP_ADD: Op.ADD, ext.Intervention.OP_SET: Op.SET, ext.Intervention.OP_ABLATE: Op.ABLATE}


class ExtensionsService(extensions_pb2_grpc.SalienceExtensionsServicer):
    def __init__(self, status: ServerStatus, sessions: SessionStore) -> None:
        self._status = status
        self._sessions = sessions

    @translating_stream
    async def SteeredGenerate(
        self, request: ext.SteeredGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        turn = turn_from(request.generate, REQUEST_ID.get(), interventions(request.interventions))
        async with contextlib.aclosing(
            run_turn(self._status, self._sessions, request.generate.session_id, turn)
        ) as events:
            async for event in events:
                yield event

    @translating
    async def GetSteeringManifest(self, request: ext.GetSteeringManifestRequest, context: grpc.aio.ServicerContext):
        steering = self._status.serving_engine().steering
        manifest = ext.SteeringManifest(max_interventions=MAX_INTERVENTIONS, max_magnitude=MAX_MAGNITUDE)
        if steering is not None:
            manifest.directions.extend(
                ext.SteeringManifest.Direction(name=name, layers=layers)
                for name, layers in steering.manifest()["directions"].items()
            )
        return manifest

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


def interventions(messages) -> tuple[Intervention, ...]:
    """Core interventions from their protobuf form; the engine checks names, layers and values."""
    if len(messages) > MAX_INTERVENTIONS:
        raise InvalidArgument(
            f"steer has {len(messages)} interventions; at most {MAX_INTERVENTIONS} are allowed per request"
        )
    out = []
    for n, m in enumerate(messages):
        if m.op not in _OPS:
            raise InvalidArgument(f"steer[{n}]: op must be OP_ADD, OP_SET or OP_ABLATE")
        out.append(
            Intervention(
                direction=m.direction,
                layers=tuple(m.layers),
                op=_OPS[m.op],
                value=m.value,
                prompt=m.prompt,
                ranges=tuple((r.start, r.end) for r in m.ranges),
                generated=m.generated,
            )
        )
    return tuple(out)
