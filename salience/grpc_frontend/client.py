"""A Python client for salience.v1 that keeps the session's length for you.

Every Generate must state the session's current length (`offset`); this client tracks it
(appended tokens plus decoded tokens as they arrive) and sends only the new tokens. If a
stream is interrupted, tokens the server already appended may not have arrived, so the next
call first re-reads the length with DumpSession.

    with SalienceClient("127.0.0.1:50051") as client:
        session = client.open_session("SmolLM2-135M-Instruct")
        result = session.generate(prompt_ids, max_tokens=16, top_k=1, readout_ranges=[(0, None)])
        branch = session.fork(len(prompt_ids))
        steered = branch.generate(more_ids, max_tokens=16, top_k=1,
                                  steer=[{"direction": "french", "layers": [15], "value": 8}])

`AsyncSalienceClient` is the same over grpc.aio, with `stream()` to consume tokens as they come,
and `chat()` to add messages to a session's conversation and run the assistant's turn.
Errors come as grpc.RpcError; `field_of(error)` names the request field at fault, if one is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import grpc

from salience.core.probes.steering import Intervention
from salience.grpc_frontend.error_fields import field_of
from salience.grpc_frontend.ledger import (
    ChatResult,
    GenerateResult,
    Ledger,
    chat_message_proto,
    defaults,
    interventions_proto,
)
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from salience.tls import ClientTls

__all__ = [
    "AsyncSalienceClient",
    "AsyncSession",
    "ChatResult",
    "GenerateResult",
    "SalienceClient",
    "Session",
    "field_of",
]


def _metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {token}"),) if token else None


def _generate_call(client, request: pb.GenerateRequest, steer: Sequence[Intervention | dict]):
    """The seed's Generate, or with interventions the extension's SteeredGenerate (same events)."""
    if not steer:
        return client._stub.Generate(request, metadata=client._metadata)
    steered = ext.SteeredGenerateRequest(generate=request, interventions=interventions_proto(steer))
    return client._extensions.SteeredGenerate(steered, metadata=client._metadata)


class Session:
    """One server session, driven synchronously."""

    def __init__(self, client: SalienceClient, session_id: str, length: int = 0) -> None:
        self._client = client
        self._ledger = Ledger(session_id, length)

    @property
    def id(self) -> str:
        return self._ledger.session_id

    @property
    def length(self) -> int:
        return self._ledger.length

    def stream(
        self,
        append: Sequence[int] = (),
        *,
        truncate_to: int | None = None,
        steer: Sequence[Intervention | dict] = (),
        **params,
    ) -> Iterator[pb.GenerateEvent]:
        """Append (after rewinding to `truncate_to`), then yield the call's events. See `generate`."""
        if not self._ledger.synced:
            self._ledger.length = len(self.dump())
        request = self._ledger.request(append, truncate_to, **defaults(params))
        call = _generate_call(self._client, request, steer)
        try:
            first = True
            for event in call:
                if first:
                    self._ledger.accepted()
                    first = False
                self._ledger.observe(event)
                yield event
        finally:
            call.cancel()  # a no-op once the call has ended; aborts the engine request otherwise

    def generate(
        self,
        append: Sequence[int] = (),
        *,
        truncate_to: int | None = None,
        steer: Sequence[Intervention | dict] = (),
        **params,
    ) -> GenerateResult:
        """One Generate: params are GenerateRequest's fields (max_tokens, logprobs_ranges,
        logprob_top_k, readout_ranges, temperature, top_p, top_k, stop_token_ids, priority, images).
        A range `(start, None)` runs through the last position this call can produce. `steer`
        (Interventions, or dicts in their LMTP form) makes it a SteeredGenerate (docs/steering.md)."""
        result = GenerateResult()
        for event in self.stream(append, truncate_to=truncate_to, steer=steer, **params):
            result.add(event)
        return result

    def fork(self, at_position: int) -> Session:
        reply = self._client._stub.ForkSession(
            pb.ForkSessionRequest(session_id=self.id, at_position=at_position), metadata=self._client._metadata
        )
        return Session(self._client, reply.session_id, at_position)

    def dump(self) -> list[int]:
        reply = self._client._stub.DumpSession(
            pb.DumpSessionRequest(session_id=self.id), metadata=self._client._metadata
        )
        return list(reply.tokens)

    def close(self) -> None:
        self._client._stub.CloseSession(pb.CloseSessionRequest(session_id=self.id), metadata=self._client._metadata)


class SalienceClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        channel: grpc.Channel | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        """`tls`: a TLS channel, trusting its CA and presenting its certificate (mutual TLS)."""
        self._channel = channel or (
            grpc.insecure_channel(target) if tls is None else grpc.secure_channel(target, tls.grpc_credentials())
        )
        self._stub = salience_pb2_grpc.SalienceStub(self._channel)
        self._extensions = extensions_pb2_grpc.SalienceExtensionsStub(self._channel)
        self._metadata = _metadata(token)

    def open_session(self, model: str) -> Session:
        reply = self._stub.OpenSession(pb.OpenSessionRequest(model=model), metadata=self._metadata)
        self.max_model_len = reply.max_model_len
        return Session(self, reply.session_id)

    def readout_manifest(self) -> pb.ReadoutManifest:
        return self._stub.GetReadoutManifest(pb.GetReadoutManifestRequest(), metadata=self._metadata)

    def steering_manifest(self) -> ext.SteeringManifest:
        return self._extensions.GetSteeringManifest(ext.GetSteeringManifestRequest(), metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SalienceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSession:
    """One server session, driven from asyncio."""

    def __init__(self, client: AsyncSalienceClient, session_id: str, length: int = 0) -> None:
        self._client = client
        self._ledger = Ledger(session_id, length)

    @property
    def id(self) -> str:
        return self._ledger.session_id

    @property
    def length(self) -> int:
        return self._ledger.length

    async def stream(
        self,
        append: Sequence[int] = (),
        *,
        truncate_to: int | None = None,
        steer: Sequence[Intervention | dict] = (),
        **params,
    ) -> AsyncIterator[pb.GenerateEvent]:
        request = await self._request(append, truncate_to, params)
        async for event in self._follow(_generate_call(self._client, request, steer), lambda e: e):
            yield event

    async def extended(
        self,
        append: Sequence[int] = (),
        *,
        truncate_to: int | None = None,
        steer: Sequence[Intervention | dict] = (),
        residual: ext.Residual | None = None,
        features: ext.Features | None = None,
        constraint: ext.Constraint | None = None,
        patches: Sequence[ext.Patch] = (),
        **params,
    ) -> AsyncIterator[ext.ExtendedGenerateEvent]:
        """stream() through ExtendedGenerate: each event with its residual rows and SAE features;
        under `constraint`, the text matches it; `patches` replace activations."""
        request = ext.ExtendedGenerateRequest(
            generate=await self._request(append, truncate_to, params),
            interventions=interventions_proto(steer),
            residual=residual,
            features=features,
            constraint=constraint,
            patches=patches,
        )
        call = self._client._extensions.ExtendedGenerate(request, metadata=self._client._metadata)
        async for event in self._follow(call, lambda e: e.event):
            yield event

    async def chat_stream(
        self,
        messages: Sequence[dict | ext.ChatMessage],
        *,
        steer: Sequence[Intervention | dict] = (),
        monitors: Sequence[ext.Monitor] = (),
        readout_format: int = 0,
        residual: ext.Residual | None = None,
        features: ext.Features | None = None,
        constraint: ext.Constraint | None = None,
        **params,
    ) -> AsyncIterator[ext.ChatGenerateEvent]:
        """ChatGenerate: `messages` (OpenAI's JSON form, or ChatMessage protobufs) join the session's
        conversation, then the assistant's turn runs; params are GenerateRequest's, as in
        `generate`, and a range `(start, None)` runs through the end of the call. Yields where the
        template's tokens went, then the turn's ExtendedGenerateEvents, the last with the reply."""
        await self._sync()
        turn = ext.ExtendedGenerateRequest(
            generate=self._ledger.request((), None, **defaults(params), chat=True),
            interventions=interventions_proto(steer),
            monitors=monitors,
            readout_format=readout_format,
            residual=residual,
            features=features,
            constraint=constraint,
        )
        request = ext.ChatGenerateRequest(turn=turn, messages=[chat_message_proto(m) for m in messages])
        call = self._client._extensions.ChatGenerate(request, metadata=self._client._metadata)
        try:
            async for event in call:
                self._ledger.observe_chat(event)
                yield event
        finally:
            call.cancel()  # a no-op once the call has ended; aborts the engine request otherwise

    async def chat(self, messages: Sequence[dict | ext.ChatMessage], **params) -> ChatResult:
        result = ChatResult()
        async for event in self.chat_stream(messages, **params):
            result.add_chat(event)
        return result

    async def _sync(self) -> None:
        """After an interrupted stream, re-read the length the client may have missed tokens of."""
        if not self._ledger.synced:
            self._ledger.length = len(await self.dump())

    async def _request(self, append: Sequence[int], truncate_to: int | None, params: dict) -> pb.GenerateRequest:
        await self._sync()
        return self._ledger.request(append, truncate_to, **defaults(params))

    async def _follow(self, call, seed) -> AsyncIterator:
        """The call's events, the ledger learning from each (`seed`: its seed GenerateEvent)."""
        try:
            first = True
            async for event in call:
                if first:
                    self._ledger.accepted()
                    first = False
                self._ledger.observe(seed(event))
                yield event
        finally:
            call.cancel()  # a no-op once the call has ended; aborts the engine request otherwise

    async def generate(
        self,
        append: Sequence[int] = (),
        *,
        truncate_to: int | None = None,
        steer: Sequence[Intervention | dict] = (),
        **params,
    ) -> GenerateResult:
        result = GenerateResult()
        async for event in self.stream(append, truncate_to=truncate_to, steer=steer, **params):
            result.add(event)
        return result

    async def fork(self, at_position: int) -> AsyncSession:
        reply = await self._client._stub.ForkSession(
            pb.ForkSessionRequest(session_id=self.id, at_position=at_position), metadata=self._client._metadata
        )
        return AsyncSession(self._client, reply.session_id, at_position)

    async def dump(self) -> list[int]:
        reply = await self._client._stub.DumpSession(
            pb.DumpSessionRequest(session_id=self.id), metadata=self._client._metadata
        )
        return list(reply.tokens)

    async def close(self) -> None:
        await self._client._stub.CloseSession(
            pb.CloseSessionRequest(session_id=self.id), metadata=self._client._metadata
        )


class AsyncSalienceClient:
    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        channel: grpc.aio.Channel | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        """`tls`: a TLS channel, trusting its CA and presenting its certificate (mutual TLS)."""
        self._channel = channel or (
            grpc.aio.insecure_channel(target)
            if tls is None
            else grpc.aio.secure_channel(target, tls.grpc_credentials())
        )
        self._stub = salience_pb2_grpc.SalienceStub(self._channel)
        self._extensions = extensions_pb2_grpc.SalienceExtensionsStub(self._channel)
        self._metadata = _metadata(token)

    async def open_session(self, model: str) -> AsyncSession:
        reply = await self._stub.OpenSession(pb.OpenSessionRequest(model=model), metadata=self._metadata)
        self.max_model_len = reply.max_model_len
        return AsyncSession(self, reply.session_id)

    async def readout_manifest(self) -> pb.ReadoutManifest:
        return await self._stub.GetReadoutManifest(pb.GetReadoutManifestRequest(), metadata=self._metadata)

    async def steering_manifest(self) -> ext.SteeringManifest:
        return await self._extensions.GetSteeringManifest(ext.GetSteeringManifestRequest(), metadata=self._metadata)

    async def sae_manifest(self) -> ext.SAEManifest:
        return await self._extensions.GetSAEManifest(ext.GetSAEManifestRequest(), metadata=self._metadata)

    async def concept_manifest(self) -> ext.ConceptManifest:
        return await self._extensions.GetConceptManifest(ext.GetConceptManifestRequest(), metadata=self._metadata)

    async def define_concept(self, name: str, **fields) -> ext.DefineConceptResponse:
        """DefineConcept: `positive` and `negative` examples (and `method`, `layers`), or `vector` /
        `vectors` (float32 bytes); needs the operator token on a server with auth."""
        request = ext.DefineConceptRequest(name=name, **fields)
        return await self._extensions.DefineConcept(request, metadata=self._metadata)

    async def delete_concept(self, name: str) -> ext.DeleteConceptResponse:
        return await self._extensions.DeleteConcept(ext.DeleteConceptRequest(name=name), metadata=self._metadata)

    async def save_concepts(self) -> bytes:
        """The server's concepts, live ones included, as a concept-set file's bytes."""
        reply = await self._extensions.SaveConcepts(ext.SaveConceptsRequest(), metadata=self._metadata)
        return reply.concept_set

    async def sweep(self, progress: Callable[[int, int], None] | None = None, **fields) -> ext.SweepGrid:
        """PatchSweep (docs/patching.md): `clean`, `corrupted`, `answer` token ids and the rest of
        PatchSweepRequest's fields; `progress(done, total)` as cells finish. Cancelling the call
        cancels the sweep."""
        call = self._extensions.PatchSweep(ext.PatchSweepRequest(**fields), metadata=self._metadata)
        async for event in call:
            if event.HasField("grid"):
                return event.grid
            if progress is not None:
                progress(event.progress.done, event.progress.total)
        raise ConnectionError("the sweep ended without its grid")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncSalienceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
