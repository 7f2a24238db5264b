"""Where captured rows come from: the engine in this process, or a running server over gRPC.

Both run each document as one prefill-only request asking for its residual rows
(docs/residuals.md), `batch` documents at a time so their prefills share engine steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from salience.core.engine.requests import Probes, ResidualRequest
from salience.core.models.reading import text_ids
from salience.core.probes.concepts import capture_concepts

__all__ = ["EngineSource", "GrpcSource", "Source"]

Rows = tuple[np.ndarray, np.ndarray]  # positions [n], rows [n, layers, hidden] float32


class Source(Protocol):
    max_model_len: int
    hidden_size: int

    def tokenize(self, text: str) -> list[int]: ...

    async def rows(self, documents: Sequence[list[int]], layers: Sequence[int], start: int) -> list[Rows]: ...

    async def close(self) -> None: ...


def no_rows(layers: int, hidden: int) -> Rows:
    """A document too short to have a position at or after the first one captured."""
    return np.zeros(0, np.int64), np.zeros((0, layers, hidden), np.float32)


class EngineSource:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.hidden_size = engine.hidden_size

    @classmethod
    async def start(
        cls, model: Path, layers: Sequence[int], max_model_len: int | None = None, compile: bool = True
    ) -> EngineSource:
        from salience.core.engine.engine import Engine
        from salience.core.engine.settings import EngineSettings

        settings = EngineSettings(
            model=model,
            served_model_name=model.name,
            concepts=capture_concepts(model, layers),
            steering=False,
            spare_concepts=0,
            max_model_len=max_model_len,
            compile=compile,
        )
        return cls(await Engine.start(settings))

    def tokenize(self, text: str) -> list[int]:
        return text_ids(self.engine.tokenizer, text)

    async def rows(self, documents: Sequence[list[int]], layers: Sequence[int], start: int) -> list[Rows]:
        async def one(ids: list[int]) -> Rows:
            if len(ids) <= start:
                return no_rows(len(layers), self.hidden_size)
            residual = ResidualRequest(layers=tuple(layers), ranges=((start, len(ids)),))
            scores = await self.engine.prefill(ids, probes=Probes(residual=residual))
            positions = sorted(scores.residuals)
            return np.array(positions, np.int64), np.stack([scores.residuals[p] for p in positions])

        return list(await asyncio.gather(*map(one, documents)))

    async def close(self) -> None:
        self.engine.shutdown()


class GrpcSource:
    """A running `salience serve`: each document is a session's prefill (ExtendedGenerate with
    max_tokens 0 and a Residual), tokenized here with the served model's own tokenizer."""

    def __init__(self, client, tokenizer, max_model_len: int, hidden_size: int, model_name: str) -> None:
        self._client = client
        self._tokenizer = tokenizer
        self._model_name = model_name
        self.max_model_len = max_model_len
        self.hidden_size = hidden_size

    @classmethod
    async def connect(cls, target: str, token: str | None, model: Path) -> GrpcSource:
        from transformers import AutoTokenizer

        from salience.grpc_frontend.client import AsyncSalienceClient

        client = AsyncSalienceClient(target, token=token)
        manifest = await client.readout_manifest()
        if not manifest.concepts:
            await client.close()
            raise ConnectionError(f"the server at {target} reads no concepts: residual rows need its taps")
        session = await client.open_session("")  # learns max_model_len
        await session.close()
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        return cls(client, tokenizer, client.max_model_len, manifest.hidden_size, "")

    def tokenize(self, text: str) -> list[int]:
        return text_ids(self._tokenizer, text)

    async def rows(self, documents: Sequence[list[int]], layers: Sequence[int], start: int) -> list[Rows]:
        from salience.proto.salience.ext.v1 import extensions_pb2 as ext
        from salience.proto.salience.v1 import salience_pb2 as pb

        client = self._client

        async def one(ids: list[int]) -> Rows:
            if len(ids) <= start:
                return no_rows(len(layers), self.hidden_size)
            session = await client.open_session(self._model_name)
            try:
                residual = ext.Residual(layers=layers, ranges=[pb.PositionRange(start=start, end=len(ids))])
                positions, rows = [], []
                async for event in session.extended(ids, max_tokens=0, residual=residual):
                    if event.event.HasField("token") and event.residual:
                        positions.append(event.event.token.position)
                        rows.append(np.frombuffer(event.residual, "<f4").reshape(len(layers), self.hidden_size))
            finally:
                await session.close()
            return np.array(positions, np.int64), np.stack(rows)

        return list(await asyncio.gather(*map(one, documents)))

    async def close(self) -> None:
        await self._client.close()
