"""GET /metrics: Salience's counters move by exactly what clients did, and vLLM's engine metrics are there.

One engine with a concept set serves the WebSocket (with a token), plain TCP and gRPC (with the
same token) at once; a mixed run goes through all three and the scrape after it is compared
with the scrape before.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from salience.auth import Tokens
from salience.core.probes.concepts import ConceptSet
from salience.core.serving.sessions import SessionLimits, SessionStore
from salience.grpc_frontend.client import AsyncSalienceClient
from salience.lmtp.codec import parse_server_line
from salience.lmtp.session import ConnectionLimits, LmtpConfig, LmtpSession
from salience.proto.salience.v1 import salience_pb2 as pb
from salience.proto.salience.v1 import salience_pb2_grpc
from tests.conftest import start_engine
from tests.inprocess import Frontends, frontends

TOKEN = "metrics-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
AUTH_GRPC = ("authorization", f"Bearer {TOKEN}")
PROMPT = [0, *range(40, 50)]
LIMITS = ConnectionLimits(max_message_bytes=4096, max_frame_bytes=8192)  # small, to send a frame over them


@pytest_asyncio.fixture(scope="module")
async def server(tiny_model: Path, tiny_concepts: ConceptSet) -> AsyncIterator[Frontends]:
    # Its own start, not the pooled read_engine: vLLM's stat logger of the engine started last owns
    # the vllm:* metrics (each start unregisters the ones before), and a pooled engine started
    # before other modules' engines has lost them.
    engine = await start_engine(tiny_model, served_model_name="tiny", max_model_len=1024, concepts=tiny_concepts)
    lmtp, tcp = LmtpConfig(tokens=Tokens(TOKEN), limits=LIMITS), LmtpConfig(limits=LIMITS)
    async with frontends(engine, lmtp=lmtp, tcp=tcp, grpc_tokens=Tokens(TOKEN)) as served:
        yield served
    engine.shutdown()


Samples = dict[tuple[str, frozenset], float]


async def scrape(http: aiohttp.ClientSession, url: str) -> Samples:
    async with http.get(f"{url}/metrics", headers=AUTH) as response:
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def line(kind: str, **body) -> str:
    return f"{kind} {json.dumps(body)}"


async def ws_stream(ws: aiohttp.ClientWebSocketResponse, stream_id: int) -> list[dict]:
    """Read frames until `stream_id` ends (other streams' payloads are dropped)."""
    payloads = []
    while True:
        kind, items = parse_server_line((await asyncio.wait_for(ws.receive(), 60)).data)
        for item in items:
            if kind == "TOKEN" and item["stream_id"] == stream_id:
                payloads.append(item)
                if item.get("error") is not None or item.get("finish_reason") is not None:
                    return payloads


async def ws_message(ws: aiohttp.ClientWebSocketResponse) -> dict:
    kind, items = parse_server_line((await asyncio.wait_for(ws.receive(), 60)).data)
    assert kind == "MSG" and len(items) == 1
    return items[0]


def readout_sizes(payloads: list[dict]) -> tuple[int, int]:
    """Positions with a readout, and the JSON bytes of those readouts, as the server counts them."""
    readouts = [p["readout"] for p in payloads if "readout" in p]
    return len(readouts), sum(len(orjson.dumps(r)) for r in readouts)


async def test_counters_move_by_exactly_what_the_clients_did(server: Frontends) -> None:
    # The session gauges sum every live SessionStore: let earlier modules' stores go first.
    gc.collect()
    async with aiohttp.ClientSession() as http:
        before = await scrape(http, server.http)
        positions = readout_bytes = 0

        # Over the WebSocket: a generation with readouts (prompt + every decoded token, the last
        # one read by an extra pass), a score, two errors of known kinds, and a session turn.
        async with http.ws_connect(server.http, headers=AUTH) as ws:
            end = len(PROMPT) + 5
            generate = line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=5, ignore_eos=True, readout=[[0, end]])
            await ws.send_str(generate)
            generated = await ws_stream(ws, 1)
            assert generated[-1]["finish_reason"] == "length" and len(generated) == end
            n, size = readout_sizes(generated)
            assert n == end  # every position, the last token's included
            positions, readout_bytes = positions + n, readout_bytes + size

            await ws.send_str(line("SCORE", stream_id=2, prompt=PROMPT, scored=[5, 6, 7]))
            assert [p["finish_reason"] for p in await ws_stream(ws, 2)] == [None, None, "length"]

            await ws.send_str(line("GENERATE", stream_id=3, prompt=[10**6], max_tokens=2))  # not a token id
            assert "not a token id" in (await ws_stream(ws, 3))[0]["error"]
            await ws.send_str(line("GENERATE", stream_id=4, prompt=PROMPT, max_tokenz=2))  # the codec refuses it
            assert "unknown field 'max_tokenz'" in (await ws_stream(ws, 4))[0]["error"]

            await ws.send_str(line("OPEN_SESSION", stream_id=5))
            session_id = (await ws_message(ws))["session_id"]
            turn = line("SESSION_GENERATE", stream_id=6, session_id=session_id, offset=0, append=PROMPT, max_tokens=3)
            await ws.send_str(turn)
            assert (await ws_stream(ws, 6))[-1]["usage"]["total_tokens"] == len(PROMPT) + 3

        # A client that goes away with a stream running: its connection counts as dropped.
        async with http.ws_connect(server.http, headers=AUTH) as ws:
            await ws.send_str(line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=900, ignore_eos=True))
            await ws_stream_first(ws)

        # Over plain TCP: one generation.
        reader, writer = await asyncio.open_connection("127.0.0.1", server.tcp_port)
        writer.write(line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=4).encode() + b"\n")
        payloads = []
        while not payloads or payloads[-1].get("finish_reason") is None:
            payloads += parse_server_line((await asyncio.wait_for(reader.readline(), 60)).decode())[1]
        writer.close()

        # Over gRPC: a session turn with readouts on the decoded tokens, and a NotFound.
        async with AsyncSalienceClient(server.grpc_target, token=TOKEN) as client:
            session = await client.open_session("tiny")
            result = await session.generate(PROMPT, max_tokens=4, top_k=1, readout_ranges=[(len(PROMPT), None)])
            read = [t.readout for t in result.tokens if t.readout]
            assert len(read) == 4
            positions_grpc, bytes_grpc = len(read), sum(4 * len(r) for r in read)
            channel = grpc.aio.insecure_channel(server.grpc_target)
            stub = salience_pb2_grpc.SalienceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                async for _ in stub.Generate(pb.GenerateRequest(session_id="nope"), metadata=(AUTH_GRPC,)):
                    pass
            assert missing.value.code() is grpc.StatusCode.NOT_FOUND
            # Auth failures, one per frontend: gRPC, the WebSocket, and /metrics itself.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.OpenSession(pb.OpenSessionRequest(model="tiny"))
            assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
            await channel.close()
        async with http.ws_connect(server.http) as ws:
            assert (await ws.receive()).type is aiohttp.WSMsgType.CLOSE and ws.close_code == 4401
        async with http.get(f"{server.http}/metrics") as response:
            assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        async with http.get(f"{server.http}/metrics", headers={"Authorization": "Bearer wrong"}) as response:
            assert response.status == 401

        # Sessions evicted by TTL and by LRU (stores of their own, counted in the same metrics).
        clock = [0.0]
        store = SessionStore(
            server.status.serving_engine, SessionLimits(ttl=10, max_sessions=1), clock=lambda: clock[0]
        )
        store.open()
        store.open()  # the first goes: LRU
        clock[0] = 11.0
        assert store.sweep() == 1  # the second goes: TTL
        del store

        await wait_until_idle(http, server.http)
        after = await scrape(http, server.http)

    def streams(name: str, frontend: str, kind: str, **labels: str) -> float:
        return delta(before, after, name, frontend=frontend, kind=kind, **labels)

    started, ended = "salience_streams_started_total", "salience_streams_ended_total"
    assert streams(started, "lmtp_ws", "generate") == 3  # 1, 3 (failed in the engine's checks), the dropped one
    assert streams(started, "lmtp_ws", "score") == 1
    assert streams(started, "lmtp_ws", "session_generate") == 1
    assert streams(started, "lmtp_tcp", "generate") == 1
    assert streams(started, "grpc", "session_generate") == 2  # the turn, and the NotFound
    assert streams(ended, "lmtp_ws", "generate", finish_reason="length") == 1
    assert streams(ended, "lmtp_ws", "generate", finish_reason="error") == 1
    assert streams(ended, "lmtp_ws", "generate", finish_reason="cancelled") == 1
    assert streams(ended, "lmtp_ws", "score", finish_reason="length") == 1
    assert streams(ended, "lmtp_ws", "session_generate", finish_reason="length") == 1
    assert streams(ended, "lmtp_tcp", "generate", finish_reason="length") == 1
    assert streams(ended, "grpc", "session_generate", finish_reason="length") == 1
    assert streams(ended, "grpc", "session_generate", finish_reason="error") == 1
    for frontend, kind in [("lmtp_ws", "generate"), ("lmtp_ws", "score"), ("grpc", "session_generate")]:
        assert after[("salience_streams_active", frozenset({"frontend": frontend, "kind": kind}.items()))] == 0

    errors = "salience_errors_total"
    assert delta(before, after, errors, frontend="lmtp_ws", kind="InvalidArgument") == 1
    assert delta(before, after, errors, frontend="lmtp_ws", kind="LmtpError") == 1
    assert delta(before, after, errors, frontend="grpc", kind="NotFound") == 1

    assert delta(before, after, "salience_readout_positions_total", frontend="lmtp_ws") == positions
    assert delta(before, after, "salience_readout_bytes_total", frontend="lmtp_ws") == readout_bytes
    assert delta(before, after, "salience_readout_positions_total", frontend="grpc") == positions_grpc
    assert delta(before, after, "salience_readout_bytes_total", frontend="grpc") == bytes_grpc

    assert delta(before, after, "salience_sessions_created_total") == 4  # LMTP, gRPC, and the evicted two
    assert delta(before, after, "salience_sessions_open") == 2
    assert delta(before, after, "salience_session_tokens_stored") == (len(PROMPT) + 3) + (len(PROMPT) + 4)
    assert delta(before, after, "salience_sessions_evicted_total", reason="lru") == 1
    assert delta(before, after, "salience_sessions_evicted_total", reason="ttl") == 1

    # The residual-row budget of the serving engine (--residual-memory: 512 MiB of 128-wide rows).
    assert after[("salience_residual_rows_budget", frozenset())] >= 512 * 2**20 // (4 * 128)
    assert after[("salience_residual_rows_held", frozenset())] == 0
    assert after[("salience_residual_requests_waiting", frozenset())] == 0

    for frontend, failures in [("grpc", 1), ("lmtp_ws", 1), ("metrics", 2)]:
        assert delta(before, after, "salience_auth_failures_total", frontend=frontend) == failures
    assert delta(before, after, "salience_connections_dropped_total", frontend="lmtp_ws", cause="client_gone") == 1

    # vLLM's own, from the Prometheus stat logger (scheduler state, cache, latencies).
    model = frozenset({"model_name": "tiny", "engine": "0"}.items())
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert (gauge, model) in after, gauge
    assert after[("vllm:num_requests_running", model)] == 0
    for histogram in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert delta(before, after, f"{histogram}_count", **dict(model)) > 0, histogram
    assert delta(before, after, "vllm:prefix_cache_queries_total", **dict(model)) > 0
    assert ("vllm:prefix_cache_hits_total", model) in after


async def ws_stream_first(ws: aiohttp.ClientWebSocketResponse) -> None:
    kind, _ = parse_server_line((await asyncio.wait_for(ws.receive(), 60)).data)
    assert kind == "TOKEN"


async def wait_until_idle(http: aiohttp.ClientSession, url: str) -> None:
    """Closed connections and the dropped client's stream end a moment after their sockets close."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        samples = await scrape(http, url)
        gauges = ("salience_streams_active", "salience_connections_active")
        if all(v == 0 for (name, _), v in samples.items() if name in gauges):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("streams or connections still active")


async def test_dropped_connections_are_counted_by_cause(server: Frontends) -> None:
    async with aiohttp.ClientSession() as http:
        before = await scrape(http, server.http)
        # A frame over the hard limit closes its connection, on either transport.
        async with http.ws_connect(server.http, headers=AUTH) as ws:
            await ws.send_str("GENERATE " + " " * LIMITS.max_frame_bytes)
            assert (await ws.receive()).type is aiohttp.WSMsgType.CLOSE and ws.close_code == 1009
        reader, writer = await asyncio.open_connection("127.0.0.1", server.tcp_port)
        writer.write(b"GENERATE " + b" " * LIMITS.max_frame_bytes + b"\n")
        assert "hard limit" in (await asyncio.wait_for(reader.read(), 30)).decode()  # then EOF
        writer.close()

        # A client that stops reading, and one whose frame cannot be sent in time.
        for limits in [
            ConnectionLimits(max_pending=50, send_timeout=600),  # slow_client
            # send_timeout: short beside the streams, which must still run when it fires
            ConnectionLimits(send_timeout=0.05),
        ]:
            session = LmtpSession(server.status, LmtpConfig(limits=limits), SessionStore(server.status.serving_engine))
            stuck = asyncio.Event()

            async def send(frame: str, stuck: asyncio.Event = stuck) -> None:
                await stuck.wait()

            pump = asyncio.create_task(session.pump(send))
            session.receive(line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=900, ignore_eos=True))
            session.receive(line("GENERATE", stream_id=2, prompt=PROMPT, max_tokens=900, ignore_eos=True))
            await asyncio.wait_for(session.closed.wait(), 60)
            session.close()  # as the transport adapter does
            await session.wait_closed()
            pump.cancel()

        await wait_until_idle(http, server.http)
        after = await scrape(http, server.http)

    dropped = "salience_connections_dropped_total"
    assert delta(before, after, dropped, frontend="lmtp_ws", cause="oversized_frame") == 1
    assert delta(before, after, dropped, frontend="lmtp_tcp", cause="oversized_frame") == 1
    assert delta(before, after, dropped, frontend="lmtp_ws", cause="slow_client") == 1
    assert delta(before, after, dropped, frontend="lmtp_ws", cause="send_timeout") == 1
    assert delta(before, after, dropped, frontend="lmtp_ws", cause="client_gone") == 0
    assert delta(before, after, "salience_errors_total", frontend="lmtp_ws", kind="SlowClient") == 2
    assert (
        delta(
            before,
            after,
            "salience_streams_ended_total",
            frontend="lmtp_ws",
            kind="generate",
            finish_reason="cancelled",
        )
        == 4
    )
