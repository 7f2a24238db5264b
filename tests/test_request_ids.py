"""Request ids: one id follows a request from the client through Salience's log lines into vLLM.

Ids come from the LMTP `request_id` field, the WebSocket's `x-request-id` header (a prefix per
stream) and gRPC `x-request-id` metadata, or are made by the server. The test captures every
log record the server writes (vLLM's frontend half included), stamped by the same filter
`salience serve` installs, and checks the lines, vLLM's own "Added request" lines, and what the
client receives.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Iterator

import aiohttp
import grpc
import pytest
import pytest_asyncio

from salience.core.engine.engine import Engine
from salience.lmtp.codec import LmtpError, parse_client_line, parse_server_line
from salience.logs import LogfmtFormatter, RequestIdFilter
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.inprocess import Frontends, frontends
from tests.test_metrics import line, ws_stream

PROMPT = [0, *range(60, 70)]
HEX32 = re.compile(r"[0-9a-f]{32}")


@pytest_asyncio.fixture(scope="module")
async def server(read_engine: Engine) -> AsyncIterator[Frontends]:
    async with frontends(read_engine) as served:
        yield served


class Lines:
    """Every record logged by Salience and vLLM, formatted as `salience serve` writes it."""

    def __init__(self) -> None:
        self.records: list[logging.LogRecord] = []
        self.formatter = LogfmtFormatter()

    def about(self, request_id: str) -> list[str]:
        return [self.formatter.format(r) for r in self.records if getattr(r, "request_id", None) == request_id]

    def vllm_added(self, request_id: str) -> list[str]:
        """vLLM's ids in its "Added request <id>." lines for requests we gave `request_id`."""
        found = (re.fullmatch(r"Added request (\S+)\.", r.getMessage()) for r in self.records)
        return [m.group(1) for m in found if m and m.group(1).rsplit("-", 1)[0] == request_id]


@pytest.fixture
def lines() -> Iterator[Lines]:
    captured = Lines()
    handler = logging.Handler(logging.DEBUG)
    handler.emit = captured.records.append
    handler.addFilter(RequestIdFilter())  # what setup_logging puts on the server's handler
    loggers = [logging.getLogger("salience"), logging.getLogger("vllm")]  # vLLM's does not propagate
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield captured
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_an_lmtp_request_id_reaches_the_logs_vllm_and_the_client(server: Frontends, lines: Lines) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws) as ws:
        # The last token's readout comes from a lookahead step of the same request: no <id>-last pass.
        end = len(PROMPT) + 3
        body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True, "readout": [[end - 1, end]]}
        await ws.send_str(line("GENERATE", stream_id=1, request_id="client-7:a.b_c", **body))
        payloads = await ws_stream(ws, 1)
        assert payloads[-1]["finish_reason"] == "length" and payloads[-1]["request_id"] == "client-7:a.b_c"
        assert all("request_id" not in p for p in payloads[:-1])  # only the terminal payload names it
        assert "readout" in payloads[-1]

        await ws.send_str(line("SCORE", stream_id=2, prompt=PROMPT, scored=[1, 2], request_id="score-1"))
        assert (await ws_stream(ws, 2))[-1]["request_id"] == "score-1"

        await ws.send_str(line("GENERATE", stream_id=3, prompt=[10**6], request_id="bad-prompt"))
        error = (await ws_stream(ws, 3))[0]
        assert "not a token id" in error["error"] and error["request_id"] == "bad-prompt"

        await ws.send_str(line("OPEN_SESSION", stream_id=4))
        session_id = parse_server_line((await ws.receive()).data)[1][0]["session_id"]
        turn = {"session_id": session_id, "offset": 0, "append": PROMPT, "max_tokens": 2}
        await ws.send_str(line("SESSION_GENERATE", stream_id=5, request_id="turn-1", **turn))
        assert (await ws_stream(ws, 5))[-1]["request_id"] == "turn-1"

    generate = lines.about("client-7:a.b_c")
    assert any('msg="stream started"' in x and "request_id=client-7:a.b_c" in x for x in generate), generate
    assert any('msg="stream ended"' in x and "finish_reason=length" in x for x in generate), generate
    # vLLM's own lines, logged from the stream's task, carry the id in their text and their field.
    assert len(lines.vllm_added("client-7:a.b_c")) == 1
    assert not lines.vllm_added("client-7:a.b_c-last")
    assert any("logger=vllm" in x and "Added request client-7:a.b_c-" in x for x in generate), generate
    assert len(lines.vllm_added("score-1")) == 1 and len(lines.vllm_added("turn-1")) == 1
    # A request that finished is not reported aborted (its vLLM generator is run to its end).
    assert not [x for x in generate if "abort" in x.lower()], generate
    failed = lines.about("bad-prompt")
    assert any("level=info" in x and 'msg="request failed"' in x and "kind=InvalidArgument" in x for x in failed)
    assert not lines.vllm_added("bad-prompt")  # refused before it reached the engine


async def test_the_websocket_header_prefixes_each_stream_and_servers_make_the_rest(
    server: Frontends, lines: Lines
) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.ws_connect(server.ws, headers={"x-request-id": "edge-42"}) as ws:
            await ws.send_str(line("GENERATE", stream_id=7, prompt=PROMPT, max_tokens=2))
            assert (await ws_stream(ws, 7))[-1]["request_id"] == "edge-42-7"
            await ws.send_str(line("GENERATE", stream_id=8, prompt=PROMPT, max_tokens=2, request_id="own"))
            assert (await ws_stream(ws, 8))[-1]["request_id"] == "own"  # the field wins
            await ws.send_str(line("GENERATE", stream_id=9, prompt=PROMPT, max_tokens=0))
            assert (await ws_stream(ws, 9))[0]["request_id"] == "edge-42-9"
            await ws.send_str(line("CLOSE_SESSION", stream_id=10))  # MSG errors name a request too
            kind, (reply,) = parse_server_line((await ws.receive()).data)
            assert (
                kind == "MSG" and "missing field 'session_id'" in reply["error"] and reply["request_id"] == "edge-42-10"
            )
        assert lines.vllm_added("edge-42-7") and lines.about("edge-42-9")

        async with http.ws_connect(server.ws) as ws:
            await ws.send_str(line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=2))
            made = (await ws_stream(ws, 1))[-1]["request_id"]
            assert HEX32.fullmatch(made) and lines.vllm_added(made)

        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(server.ws, headers={"x-request-id": "no spaces"})
        assert refused.value.status == 400


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        ("", "non-empty"),
        ("a" * 129, "at most 128"),
        ("has space", "may only hold"),
        ("naïve", "may only hold"),
        (7, "non-empty string"),
    ],
)
def test_a_bad_request_id_field_is_a_stream_error(request_id, message: str) -> None:
    with pytest.raises(LmtpError) as error:
        parse_client_line(line("GENERATE", stream_id=3, prompt=[1], request_id=request_id))
    assert error.value.stream_id == 3 and message in error.value.message and error.value.request_id is None
    assert parse_client_line(line("SCORE", stream_id=1, prompt=[1], scored=[2], request_id="a" * 128)).request_id
    with pytest.raises(LmtpError) as other:  # a valid id names the error about another field
        parse_client_line(line("GENERATE", stream_id=3, prompt="x", request_id="mine"))
    assert other.value.request_id == "mine"


async def test_a_reused_in_flight_id_is_suffixed_and_cancel_stops_only_its_own_stream(
    server: Frontends, lines: Lines
) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(server.ws) as ws:
        body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "request_id": "same"}
        await ws.send_str(line("GENERATE", stream_id=1, **body))
        firsts, ends = set(), {}

        async def read() -> None:
            for item in parse_server_line((await asyncio.wait_for(ws.receive(), 60)).data)[1]:
                firsts.add(item["stream_id"])
                if item.get("finish_reason"):
                    ends[item["stream_id"]] = item

        while 1 not in firsts:  # stream 1 is running in vLLM
            await read()
        await ws.send_str(line("GENERATE", stream_id=2, **(body | {"max_tokens": 40})))
        while 2 not in firsts:  # and now stream 2 too, with the same id
            await read()
        await ws.send_str(line("CANCEL", stream_id=1))
        while len(ends) < 2:
            await read()
    assert ends[1]["finish_reason"] == "cancelled" and ends[2]["finish_reason"] == "length"
    assert ends[1]["request_id"] == ends[2]["request_id"] == "same"  # the client's id, as it sent it
    assert len(lines.vllm_added("same")) == 1 and len(lines.vllm_added("same.2")) == 1
    # The CANCEL's abort is logged in the stream's context, so it names the request too.
    assert any('msg="Aborted request(s) same."' in x for x in lines.about("same")), lines.about("same")
    assert not [x for x in lines.about("same") if "same.2" in x and "abort" in x.lower()]


async def test_grpc_metadata_names_the_call_in_logs_vllm_metadata_and_errors(server: Frontends, lines: Lines) -> None:
    async with grpc.aio.insecure_channel(server.grpc_target) as channel:
        stub = salience_pb2_grpc.SalienceStub(channel)
        opened = stub.OpenSession(pb.OpenSessionRequest(model="tiny"), metadata=(("x-request-id", "rpc-open"),))
        session_id = (await opened).session_id
        assert ("x-request-id", "rpc-open") in tuple(await opened.initial_metadata())

        request = pb.GenerateRequest(session_id=session_id, append_tokens=PROMPT, max_tokens=3, top_k=1)
        call = stub.Generate(request, metadata=(("x-request-id", "rpc-gen.1"),))
        events = [event async for event in call]
        assert events[-1].done.completion_tokens == 3
        assert ("x-request-id", "rpc-gen.1") in tuple(await call.initial_metadata())
        assert len(lines.vllm_added("rpc-gen.1")) == 1
        assert any("stream ended" in x for x in lines.about("rpc-gen.1"))

        # Errors: the message ends with the id, and trailing metadata carries it.
        missing = stub.Generate(pb.GenerateRequest(session_id="nope"), metadata=(("x-request-id", "rpc-404"),))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in missing:
                pass
        assert error.value.code() is grpc.StatusCode.NOT_FOUND
        assert error.value.details().endswith(" (request_id=rpc-404)")
        assert ("x-request-id", "rpc-404") in tuple(error.value.trailing_metadata())
        assert any("kind=NotFound" in x for x in lines.about("rpc-404"))

        with pytest.raises(grpc.aio.AioRpcError) as made:
            await stub.DumpSession(pb.DumpSessionRequest(session_id="nope"))
        assert HEX32.fullmatch(made.value.details().rsplit("request_id=", 1)[1].rstrip(")"))

        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.DumpSession(pb.DumpSessionRequest(session_id=session_id), metadata=(("x-request-id", "a b"),))
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "x-request-id" in bad.value.details()


def test_log_lines_carry_the_callers_fields_but_no_private_ones() -> None:
    """vLLM's vllm_* stamps and private fields (Ray's _ray_timestamp_ns, once Ray is imported) stay out."""
    record = logging.LogRecord("salience.x", logging.INFO, __file__, 1, "request failed", (), None)
    record.__dict__ |= {"request_id": "r1", "code": "ABORTED", "vllm_stamp": 1, "_ray_timestamp_ns": 2}
    line = LogfmtFormatter().format(record)
    assert line.endswith(' logger=salience.x msg="request failed" request_id=r1 code=ABORTED')
