"""The salience.ext.v1.SalienceExtensions servicer: Salience's additions to the seed's service."""

from __future__ import annotations

import asyncio

import grpc

from salience.core.images import Vision
from salience.core.status import ServerStatus
from salience.grpc_frontend.status_codes import translating
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc

__all__ = ["ExtensionsService"]


class ExtensionsService(extensions_pb2_grpc.SalienceExtensionsServicer):
    def __init__(self, status: ServerStatus) -> None:
        self._status = status

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
