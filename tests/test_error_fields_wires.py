"""Bad inputs on the three wires, each refused naming the field at fault in the wire's own terms
(issue 49): OpenAI's `param`, the LMTP error payload's `field`, the gRPC BadRequest field
violation (`field_of`). One in-process server on the tiny model, with concepts and SAEs so that
steering, monitors, residual rows and features are served, answers all three."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp
import grpc
import pytest
import pytest_asyncio
from google.protobuf.message import Message

from salience.core.engine.engine import Engine
from salience.grpc_frontend.client import field_of
from salience.lmtp.codec import parse_server_line
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.inprocess import Frontends, frontends

OUTSIDE = 100_000  # not a token id of the tiny model (its vocabulary is about 2K)
TOO_LONG = 5_000  # max_tokens past the engine's context of 1024
PROMPT = [0, *range(100, 130)]
BETA = {"direction": "beta", "layers": [2], "value": 2.0}  # a concept the server steers along
ZETA = {"direction": "zeta", "layers": [2], "value": 2.0}  # no concept of the server
WATCH_ZETA = {"concept": "zeta", "above": 0.5, "action": "flag"}
WATCH_FEATURE = {"feature": 99_999, "sae": "top", "above": 0.1, "action": "flag"}  # past the SAE's 512


@pytest_asyncio.fixture(scope="module")
async def served(sae_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(sae_engine) as served:
        yield served


def cases(table: list[tuple[str, Any, str]]) -> list:
    """A table of (description, request, field) as parameters named by their description."""
    return [pytest.param(request, field, id=description) for description, request, field in table]


# ---- OpenAI: (path, body) ------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
_BASES = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
    RESPONSES: {"model": "tiny", "input": "hi", "max_output_tokens": 2, "store": False},
}

OPENAI = [
    ("temperature above OpenAI's 2", (CHAT, {"temperature": 3}), "temperature"),
    ("top_p of 0", (COMPLETIONS, {"top_p": 0}), "top_p"),
    ("a stop token outside the vocabulary", (COMPLETIONS, {"stop_token_ids": [OUTSIDE]}), "stop_token_ids[0]"),
    ("a prompt token outside the vocabulary", (COMPLETIONS, {"prompt": [1, OUTSIDE]}), "prompt[1]"),
    ("a token of a batch's second prompt", (COMPLETIONS, {"prompt": [[1, 2], [OUTSIDE]]}), "prompt[1][0]"),
    ("a completion past the context", (COMPLETIONS, {"max_tokens": TOO_LONG}), "prompt"),
    ("a message of no known role", (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}), "messages[0].role"),
    ("no messages", (CHAT, {"messages": []}), "messages"),
    ("a model not served", (CHAT, {"model": "nobody"}), "model"),
    ("steering along no concept", (COMPLETIONS, {"salience": {"steer": [ZETA]}}), "salience.steer[0]"),
    (
        "steering at a layer the model lacks",
        (COMPLETIONS, {"salience": {"steer": [{**BETA, "layers": [9]}]}}),
        "salience.steer[0]",
    ),
    ("an intervention of no known op", (CHAT, {"salience": {"steer": [{**BETA, "op": "spin"}]}}), "salience.steer[0]"),
    ("17 interventions", (COMPLETIONS, {"salience": {"steer": [BETA] * 17}}), "salience.steer"),
    (
        "a feature monitor past its SAE",
        (COMPLETIONS, {"salience": {"monitors": [WATCH_FEATURE]}}),
        "salience.monitors[0].feature",
    ),
    (
        "a monitor of a JSON field on a plain reply",
        (COMPLETIONS, {"salience": {"monitors": [{**WATCH_FEATURE, "feature": 5, "path": "$.a"}]}}),
        "salience.monitors[0].path",
    ),
    ("features.k of 0", (CHAT, {"salience": {"features": {"k": 0, "sae": "top"}}}), "salience.features.k"),
    (
        "features of an SAE not served",
        (COMPLETIONS, {"salience": {"features": {"k": 2, "sae": "nope"}}}),
        "salience.features.sae",
    ),
    ("a bias on no token id", (COMPLETIONS, {"logit_bias": {"5": 1, str(OUTSIDE): 1}}), f"logit_bias[{OUTSIDE}]"),
    (
        "features.k past the SAE's top",
        (COMPLETIONS, {"salience": {"features": {"k": 99, "sae": "top"}}}),
        "salience.features.k",
    ),
    (
        "a readouts format of no name",
        (CHAT, {"salience": {"readouts": {"format": "logit"}}}),
        "salience.readouts.format",
    ),
    (
        "a regex the backend refuses",
        (COMPLETIONS, {"structured_outputs": {"regex": "[0-9"}}),
        "structured_outputs.regex",
    ),
    (
        "two constraints in one object",
        (CHAT, {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
        "structured_outputs",
    ),
    (
        "a response_format schema that is not an object",
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 5}}}),
        "response_format.json_schema.schema",
    ),
    ("a Responses temperature above 2", (RESPONSES, {"temperature": 3}), "temperature"),
    (
        "a Responses format name with a space",
        (RESPONSES, {"text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}),
        "text.format.name",
    ),
    (
        "a Responses intervention of no known op",
        (RESPONSES, {"salience": {"steer": [{**BETA, "op": "spin"}]}}),
        "salience.steer[0]",
    ),
]


@pytest.mark.parametrize(("request_", "param"), cases(OPENAI))
async def test_openai_names_the_param(served: Frontends, request_: tuple[str, dict], param: str) -> None:
    path, body = request_
    async with aiohttp.ClientSession() as http, http.post(served.http + path, json={**_BASES[path], **body}) as sent:
        answer = await sent.json()
    assert sent.status >= 400, answer
    assert answer["error"]["param"] == param, answer


# ---- LMTP: (message type, fields) -----------------------------------------------------------------

_FIELDS = {
    "GENERATE": {"prompt": PROMPT, "max_tokens": 2},
    "SCORE": {"prompt": PROMPT[:5], "scored": PROMPT[5:]},
    "SESSION_GENERATE": {"offset": 0, "append": PROMPT, "max_tokens": 2},
}

LMTP = [
    ("a negative temperature", ("GENERATE", {"temperature": -1}), "temperature"),
    ("top_p of 0", ("GENERATE", {"top_p": 0}), "top_p"),
    ("a prompt token outside the vocabulary", ("GENERATE", {"prompt": [1, OUTSIDE]}), "prompt[1]"),
    ("a stop token outside the vocabulary", ("GENERATE", {"stop_token_ids": [OUTSIDE]}), "stop_token_ids[0]"),
    ("a generation past the context", ("GENERATE", {"max_tokens": TOO_LONG}), "prompt"),
    ("an empty readout range", ("GENERATE", {"readout": [[5, 3]]}), "readout[0]"),
    ("a readout format of no name", ("GENERATE", {"readout_format": "logit"}), "readout_format"),
    ("steering along no concept", ("GENERATE", {"steer": [ZETA]}), "steer[0]"),
    ("steering at a layer the concept lacks", ("GENERATE", {"steer": [{**BETA, "layers": [1]}]}), "steer[0]"),
    ("17 interventions", ("GENERATE", {"steer": [BETA] * 17}), "steer"),
    ("a feature monitor past its SAE", ("GENERATE", {"monitors": [WATCH_FEATURE]}), "monitors[0].feature"),
    ("a monitor's probability above 1", ("GENERATE", {"monitors": [{**WATCH_ZETA, "above": 2}]}), "monitors[0].above"),
    (
        "a monitor of a JSON field on a plain reply",
        ("GENERATE", {"monitors": [{"concept": "beta", "above": 0.5, "action": "flag", "path": "$.a"}]}),
        "monitors[0].path",
    ),
    (
        "residual rows at a layer not read",
        ("GENERATE", {"residual": {"layers": [1], "ranges": [[0, 4]]}}),
        "residual.layers",
    ),
    (
        "features.k past the SAE's top",
        ("GENERATE", {"features": {"sae": "top", "k": 99, "ranges": [[0, 4]]}}),
        "features.k",
    ),
    (
        "an empty features range",
        ("GENERATE", {"features": {"sae": "top", "k": 2, "ranges": [[3, 3]]}}),
        "features.ranges[0]",
    ),
    (
        "a regex the backend refuses",
        ("GENERATE", {"structured_outputs": {"regex": "[0-9"}}),
        "structured_outputs.regex",
    ),
    (
        "two constraints in one object",
        ("GENERATE", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
        "structured_outputs",
    ),
    (
        "a message of no known role",
        ("GENERATE", {"prompt": None, "messages": [{"role": "wizard", "content": "hi"}]}),
        "messages[0].role",
    ),
    ("a request id with a space", ("GENERATE", {"request_id": "a b"}), "request_id"),
    ("a model not served", ("GENERATE", {"model": "nobody"}), "model"),
    ("a field LMTP does not know", ("GENERATE", {"frobnicate": 1}), "frobnicate"),
    ("an empty readout range of a SCORE", ("SCORE", {"readout": [[5, 3]]}), "readout[0]"),
    ("an offset past the session's length", ("SESSION_GENERATE", {"offset": 5}), "offset"),
    ("an empty logprobs range", ("SESSION_GENERATE", {"logprobs": [[5, 3]]}), "logprobs[0]"),
    ("a session turn past the context", ("SESSION_GENERATE", {"max_tokens": TOO_LONG}), "max_tokens"),
    ("a session turn steered along no concept", ("SESSION_GENERATE", {"steer": [ZETA]}), "steer[0]"),
    ("more top logprobs than served", ("GENERATE", {"top_logprobs": 21}), "top_logprobs"),
    # The tiny concept set has no calibration: a probability view cannot be shown.
    ("a probability view with no calibration", ("GENERATE", {"readout_format": "token"}), "readout_format"),
    ("a SCORE's probability view with no calibration", ("SCORE", {"readout_format": "token"}), "readout_format"),
    (
        "a session turn's top logprobs past the limit",
        ("SESSION_GENERATE", {"logprobs": [[0, 33]], "top_logprobs": 21}),
        "top_logprobs",
    ),
    ("a scored token outside the vocabulary", ("SCORE", {"scored": [OUTSIDE]}), "scored[0]"),
    ("an appended token outside the vocabulary", ("SESSION_GENERATE", {"append": [1, OUTSIDE]}), "append[1]"),
    ("a bias on no token id", ("GENERATE", {"logit_bias": {"5": 1, str(OUTSIDE): 1}}), f"logit_bias[{OUTSIDE}]"),
    ("features of an SAE not served", ("GENERATE", {"features": {"sae": "nope", "k": 2}}), "features.sae"),
]


async def _payload(ws: aiohttp.ClientWebSocketResponse, stream_id: int) -> dict:
    """The first payload the server sends to `stream_id` (a failed stream's: its error)."""
    async for frame in ws:
        for payload in parse_server_line(frame.data)[1]:
            if payload.get("stream_id") == stream_id:
                return payload
    raise ConnectionError("connection closed")


@pytest.mark.parametrize(("request_", "field"), cases(LMTP))
async def test_lmtp_names_the_field(served: Frontends, request_: tuple[str, dict], field: str) -> None:
    kind, fields = request_
    message = {key: value for key, value in {**_FIELDS[kind], **fields}.items() if value is not None}
    async with aiohttp.ClientSession() as http, http.ws_connect(served.ws) as ws:
        if kind == "SESSION_GENERATE":
            await ws.send_str('OPEN_SESSION {"stream_id": 1}')
            message["session_id"] = (await _payload(ws, 1))["session_id"]
        await ws.send_str(f"{kind} {json.dumps({'stream_id': 2, **message})}")
        error = await _payload(ws, 2)
    assert "error" in error, error
    assert error.get("field") == field, error


# ---- gRPC: (method, request[, metadata]) ----------------------------------------------------------


class Call(NamedTuple):
    method: str  # of salience.v1.Salience (Generate) or salience.ext.v1.SalienceExtensions
    request: Message  # its session is opened for the call
    metadata: tuple[tuple[str, str], ...] = ()


def _seed(request: Message) -> pb.GenerateRequest:
    """The seed request inside a generate call's request (where its session goes)."""
    if isinstance(request, pb.GenerateRequest):
        return request
    if isinstance(request, ext.ChatGenerateRequest):
        return request.turn.generate
    return request.generate


def seed(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(**{"append_tokens": PROMPT, "max_tokens": 2, **fields})


def extended(generate: pb.GenerateRequest | None = None, **fields) -> Call:
    return Call("ExtendedGenerate", ext.ExtendedGenerateRequest(generate=generate or seed(), **fields))


def chat_turn(**fields) -> ext.ExtendedGenerateRequest:
    """A chat turn's request: its tokens are the messages'."""
    return ext.ExtendedGenerateRequest(generate=seed(append_tokens=[]), **fields)


def chat(turn: ext.ExtendedGenerateRequest | None = None, role: str = "user") -> Call:
    """A ChatGenerate call; the tiny model has no chat template, so only what is read before the
    messages are rendered can be refused by its field."""
    message = ext.ChatMessage(role=role, content="hi")
    return Call("ChatGenerate", ext.ChatGenerateRequest(turn=turn or chat_turn(), messages=[message]))


def span(start: int, end: int) -> pb.PositionRange:
    return pb.PositionRange(start=start, end=end)


def steer(
    direction: str = "beta", layers: tuple[int, ...] = (2,), op: int = ext.Intervention.OP_ADD
) -> ext.Intervention:
    return ext.Intervention(direction=direction, layers=layers, op=op, value=2.0, generated=True)


def watch(action: int = ext.Monitor.ACTION_FLAG, feature: int = 99_999) -> ext.Monitor:
    """A monitor of the `top` SAE's `feature` (by default past its 512)."""
    return ext.Monitor(feature=ext.FeatureRef(sae="top", id=feature), above=0.1, action=action)


GRPC = [
    (
        "an appended token outside the vocabulary",
        Call("Generate", seed(append_tokens=[1, OUTSIDE])),
        "append_tokens[1]",
    ),
    ("a negative temperature", Call("Generate", seed(temperature=-1)), "temperature"),
    ("a turn past the context", Call("Generate", seed(max_tokens=TOO_LONG)), "max_tokens"),
    ("an empty readout range", Call("Generate", seed(readout_ranges=[span(5, 3)])), "readout_ranges[0]"),
    ("an offset past the session's length", Call("Generate", seed(offset=5)), "offset"),
    ("a stop token outside the vocabulary", Call("Generate", seed(stop_token_ids=[OUTSIDE])), "stop_token_ids[0]"),
    ("an extended call's appended token", extended(seed(append_tokens=[1, OUTSIDE])), "generate.append_tokens[1]"),
    ("an extended call's top_p above 1", extended(seed(top_p=2)), "generate.top_p"),
    ("an extended call past the context", extended(seed(max_tokens=TOO_LONG)), "generate.max_tokens"),
    (
        "an extended call's empty readout range",
        extended(seed(readout_ranges=[span(5, 3)])),
        "generate.readout_ranges[0]",
    ),
    ("an empty logprobs range", extended(seed(logprobs_ranges=[span(5, 3)])), "generate.logprobs_ranges[0]"),
    ("steering along no concept", extended(interventions=[steer("zeta")]), "interventions[0]"),
    ("steering at a layer the model lacks", extended(interventions=[steer(layers=(9,))]), "interventions[0]"),
    (
        "an intervention of no op",
        extended(interventions=[steer(op=ext.Intervention.OP_UNSPECIFIED)]),
        "interventions[0].op",
    ),
    ("17 interventions", extended(interventions=[steer()] * 17), "interventions"),
    ("a feature monitor past its SAE", extended(monitors=[watch()]), "monitors[0].feature"),
    ("a monitor of no action", extended(monitors=[watch(ext.Monitor.ACTION_UNSPECIFIED, 5)]), "monitors[0].action"),
    (
        "features.k past the SAE's top",
        extended(features=ext.Features(sae="top", k=99, ranges=[span(0, 4)])),
        "features.k",
    ),
    (
        "an empty features range",
        extended(features=ext.Features(sae="top", k=2, ranges=[span(3, 3)])),
        "features.ranges[0]",
    ),
    (
        "residual rows at a layer not read",
        extended(residual=ext.Residual(layers=[1], ranges=[span(0, 4)])),
        "residual.layers",
    ),
    ("a regex the backend refuses", extended(constraint=ext.Constraint(regex="[0-9")), "constraint.regex"),
    ("a schema that is not JSON", extended(constraint=ext.Constraint(json="{oops")), "constraint.json"),
    (
        "a steered call along no concept",
        Call("SteeredGenerate", ext.SteeredGenerateRequest(generate=seed(), interventions=[steer("zeta")])),
        "interventions[0]",
    ),
    ("a chat message of no known role", chat(role="wizard"), "messages[0].role"),
    (
        "a chat turn's intervention of no op",
        chat(chat_turn(interventions=[steer(op=ext.Intervention.OP_UNSPECIFIED)])),
        "turn.interventions[0].op",
    ),
    (
        "a chat turn's monitor of no action",
        chat(chat_turn(monitors=[watch(ext.Monitor.ACTION_UNSPECIFIED, 5)])),
        "turn.monitors[0].action",
    ),
    (
        "a chat turn's schema that is not JSON",
        chat(chat_turn(constraint=ext.Constraint(json="{oops"))),
        "turn.constraint.json",
    ),
    ("a request id with a space", Call("Generate", seed(), (("x-request-id", "a b"),)), "x-request-id metadata"),
    (
        "more top logprobs than served",
        Call("Generate", seed(logprobs_ranges=[span(0, 33)], logprob_top_k=21)),
        "logprob_top_k",
    ),
    (
        "an extended call's top logprobs past the limit",
        extended(seed(logprobs_ranges=[span(0, 33)], logprob_top_k=21)),
        "generate.logprob_top_k",
    ),
    ("a readout format of no name", extended(readout_format=7), "readout_format"),
    ("features of an SAE not served", extended(features=ext.Features(sae="nope", k=2)), "features.sae"),
]


@pytest.mark.parametrize(("call", "field"), cases(GRPC))
async def test_grpc_names_the_field(served: Frontends, call: Call, field: str) -> None:
    request = type(call.request)()
    request.CopyFrom(call.request)
    async with grpc.aio.insecure_channel(served.grpc_target) as channel:
        seed_stub = salience_pb2_grpc.SalienceStub(channel)
        stub = seed_stub if call.method == "Generate" else extensions_pb2_grpc.SalienceExtensionsStub(channel)
        _seed(request).session_id = (await seed_stub.OpenSession(pb.OpenSessionRequest())).session_id
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in getattr(stub, call.method)(request, metadata=call.metadata or None):
                pass
    assert field_of(refused.value) == field, refused.value.details()
