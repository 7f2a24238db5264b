"""Structured outputs on gRPC (ExtendedGenerateRequest.constraint), on the default model: a chat
turn under a JSON schema and turns under a choice list follow them, and a bad constraint is
INVALID_ARGUMENT naming its member while another stream runs on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import grpc
import pytest_asyncio

from salience.auth import Tokens
from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.grpc_frontend.server import start_grpc_server
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from tests.engines import settled
from tests.grpc.test_service import status_of

PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "legs": {"type": "integer", "maximum": 8}},
    "required": ["name", "legs"],
}
ANSWERS = ["yes", "no", "it depends"]


@pytest_asyncio.fixture(scope="module")
async def target(default_engine: Engine) -> AsyncIterator[str]:
    status = ServerStatus(default_engine.model_name)
    status.ready(default_engine)
    server = await start_grpc_server(status, SessionStore(status.serving_engine), "127.0.0.1", 0, Tokens(None))
    await server.serving(True)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


def chat_prompt(engine: Engine, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


async def test_a_schema_and_a_choice_hold_on_chat_and_extended_turns(target: str, default_engine: Engine) -> None:
    name = default_engine.model_name
    async with AsyncSalienceClient(target) as client:
        session = await client.open_session(name)
        schema = ext.Constraint(json=json.dumps(PET))
        result = await session.chat(
            [{"role": "user", "content": "Describe a pet."}], max_tokens=80, top_k=1, constraint=schema
        )
        assert result.done.finish_reason == pb.GenerateDone.FINISH_REASON_EOS  # the object ended, and parses
        pet = json.loads(result.reply.content)
        assert set(pet) >= {"name", "legs"} and isinstance(pet["legs"], int) and pet["legs"] <= 8

        prompt = chat_prompt(default_engine, "Do cats like water? Answer briefly.")
        choice = ext.Constraint(choice=ext.Choices(texts=ANSWERS))

        async def answer() -> str:
            turn = await client.open_session(name)
            events = [e async for e in turn.extended(prompt, max_tokens=10, temperature=1.0, constraint=choice)]
            assert events[-1].event.done.finish_reason == pb.GenerateDone.FINISH_REASON_EOS
            ids = [e.event.token.id for e in events if e.event.HasField("token")]
            return default_engine.tokenizer.decode(ids, skip_special_tokens=True)

        assert set(await asyncio.gather(*(answer() for _ in range(8)))) <= set(ANSWERS)


async def test_a_bad_constraint_is_invalid_argument_naming_its_member_while_a_stream_runs(
    target: str, default_engine: Engine
) -> None:
    async with AsyncSalienceClient(target) as client, grpc.aio.insecure_channel(target) as channel:
        rpc = extensions_pb2_grpc.SalienceExtensionsStub(channel)
        running = await client.open_session(default_engine.model_name)
        stream = running.extended(chat_prompt(default_engine, "Count to a hundred."), max_tokens=200, top_k=1)
        await anext(stream)
        session = await client.open_session(default_engine.model_name)
        cases = [
            (ext.Constraint(regex="[0-9"), "constraint.regex: Grammar error"),
            (ext.Constraint(choice=ext.Choices()), "constraint.choice must be a non-empty list"),
            (ext.Constraint(json='{"type": "nonsense"}'), "constraint.json: Grammar error: Invalid type"),
            (ext.Constraint(json="{"), "constraint.json is not valid JSON"),
            (ext.Constraint(regex="a", grammar='root ::= "a"'), "constraint must hold exactly one"),
            (ext.Constraint(), "constraint must hold exactly one"),
            (ext.Constraint(grammar="root ::= " + '"a" ' * 20000), "constraint.grammar is 80009 characters"),
        ]
        for constraint, message in cases:
            generate = pb.GenerateRequest(session_id=session.id, append_tokens=[1, 2, 3], max_tokens=4)
            call = rpc.ExtendedGenerate(ext.ExtendedGenerateRequest(generate=generate, constraint=constraint))
            code, details = await status_of(call)
            assert code is grpc.StatusCode.INVALID_ARGUMENT and message in details, (message, details)
            assert default_engine.num_unfinished_requests() == 1  # only the running stream reached vLLM
        assert await session.dump() == []  # nothing was appended
        rest = [event async for event in stream]  # it ran on to its end, every token there
        assert rest[-1].event.done.completion_tokens == 1 + sum(e.event.HasField("token") for e in rest) > 20
    assert await settled(default_engine) == 0


async def test_a_monitor_with_a_path_fires_only_inside_that_field(target: str, default_engine: Engine) -> None:
    # Below 0.999999 holds on nearly every token, so the flag fires where the field starts.
    watch = ext.Monitor(concept="names", below=0.999999, action=ext.Monitor.ACTION_FLAG, path="$.name")
    async with AsyncSalienceClient(target) as client:
        session = await client.open_session(default_engine.model_name)
        pieces, fired = [], []
        messages = [{"role": "user", "content": "Describe a pet."}]
        schema = ext.Constraint(json=json.dumps(PET))
        async for item in session.chat_stream(messages, max_tokens=80, top_k=1, monitors=[watch], constraint=schema):
            event = item.event.event
            if item.HasField("event") and event.HasField("token") and not event.token.is_prefill:
                start = sum(map(len, pieces))
                pieces.append(default_engine.tokenizer.decode([event.token.id], skip_special_tokens=True))
                fired += [(m, start, start + len(pieces[-1])) for m in item.event.monitors]
        reply = "".join(pieces)
        name = json.loads(reply)["name"]
        begins = reply.index('"', reply.index(":", reply.index('"name"'))) + 1  # the value, quotes left out
        assert len(fired) == 1, fired
        event, start, end = fired[0]
        assert event.path == "$.name" and event.concept == "names"
        assert start < begins + len(name) and end > begins  # the field's first token
        assert start <= begins  # and not a later one

        no_json = session.chat_stream(messages, max_tokens=4, monitors=[watch])
        code, details = await status_of(no_json)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "path" in details, details
