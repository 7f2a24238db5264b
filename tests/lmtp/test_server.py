"""LMTP over real sockets against the real engine on the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import WSCloseCode, web

from salience.core.engine.requests import SamplingOptions
from salience.core.serving.status import ServerStatus
from salience.http_app import make_app
from salience.lmtp.codec import parse_server_line
from salience.lmtp.session import ConnectionLimits, LmtpConfig
from salience.lmtp.tcp import start_tcp_server
from tests.conftest import free_port
from tests.lmtp.conftest import LmtpServer

PROMPT = [0, *range(40, 60)]


def generate(stream_id: int, prompt=PROMPT, **fields) -> str:
    body = {"model": "tiny", "prompt": prompt, "stream_id": stream_id, "max_tokens": 8, "temperature": 0.0}
    body |= {"ignore_eos": True} | fields
    return "GENERATE " + json.dumps(body)


async def direct(lmtp_server: LmtpServer, prompt, max_tokens: int, **options) -> list:
    """The engine's own events for the request: max_tokens of them (ignore_eos)."""
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True, **options)
    events = [event async for event in lmtp_server.engine.generate(prompt, options)]
    assert len(events) == max_tokens
    return events


async def test_generate_payloads_have_exactly_what_lmql_reads(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(generate(1, top_logprobs=3, max_tokens=6))
    payloads = await client.stream(1)
    expected = await direct(lmtp_server, PROMPT, max_tokens=6, temperature=0.0, logprobs=3)
    assert [p["token"] for p in payloads] == [e.token_id for e in expected]
    for payload, event in zip(payloads, expected, strict=True):
        last = {"request_id"} if payload["finish_reason"] else set()  # the server made one: uuid4 hex
        assert set(payload) == {"token", "stream_id", "logprob", "finish_reason", "top_logprobs"} | last
        assert payload["stream_id"] == 1 and isinstance(payload["logprob"], float)
        assert payload["logprob"] == pytest.approx(event.logprob, abs=1e-6)
        assert payload["top_logprobs"] == pytest.approx({str(t): lp for t, lp in event.top_logprobs}, abs=1e-6)
    assert [p["finish_reason"] for p in payloads] == [None] * 5 + ["length"]
    assert len(payloads[-1]["request_id"]) == 32 and int(payloads[-1]["request_id"], 16) >= 0


async def test_score_payloads(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    scored = [300, 301, 302, 303]
    await client.send("SCORE " + json.dumps({"model": "tiny", "prompt": PROMPT, "scored": scored, "stream_id": 2}))
    payloads = await client.stream(2)
    expected = await lmtp_server.engine.score(PROMPT, scored)
    assert [p["token"] for p in payloads] == scored
    assert [p["logprob"] for p in payloads] == pytest.approx([s.logprob for s in expected], abs=1e-6)
    assert all("top_logprobs" not in p for p in payloads)
    assert [p["finish_reason"] for p in payloads] == [None, None, None, "length"]


async def test_model_info_and_tokenizer_messages(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send('MODEL_INFO {"stream_id": 3, "model": "tiny", "data": {"model": "tiny"}}')
    info = await asyncio.wait_for(client.messages.get(), 10)
    assert info["stream_id"] == 3 and info["model_info"]["model"] == "tiny"
    assert info["model_info"]["vocab_size"] == lmtp_server.engine.vocab_size
    text = "def héllo(x): return '日本' 🎉"
    await client.send("TOKENIZE " + json.dumps({"stream_id": 4, "text": text}))
    tokens = (await asyncio.wait_for(client.messages.get(), 10))["tokens"]
    assert tokens == lmtp_server.engine.tokenizer.encode(text, add_special_tokens=False)
    await client.send("DETOKENIZE " + json.dumps({"stream_id": 5, "tokens": tokens}))
    assert (await asyncio.wait_for(client.messages.get(), 10)) == {"stream_id": 5, "text": text}


async def test_text_mode_never_splits_a_character(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    text = "naïve café — 日本語のテキスト 🎉🎉 done"
    tokens = lmtp_server.engine.tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text.split())  # multi-byte characters really are split across tokens
    score = {"model": "tiny", "prompt": [0], "scored": tokens, "stream_id": 6, "text": True}
    await client.send("SCORE " + json.dumps(score))
    pieces = [p["text"] for p in await client.stream(6)]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # some token completed no character and was held back

    await client.send(generate(7, text=True, max_tokens=20))
    payloads = await client.stream(7)
    generated = [p["token"] for p in payloads]
    assert len(generated) == 20
    assert "".join(p["text"] for p in payloads) == lmtp_server.engine.tokenizer.decode(generated)


async def test_cancel_ends_the_stream_with_cancelled(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(generate(8, max_tokens=1000))
    queue = client.streams.setdefault(8, asyncio.Queue())
    first = await asyncio.wait_for(queue.get(), 30)
    await client.send('CANCEL {"stream_id": 8}')
    payloads = [first, *await client.stream(8)]
    assert payloads[-1]["finish_reason"] == "cancelled"
    assert len(payloads) < 1000
    await client.send('CANCEL {"stream_id": 8}')
    assert "not running" in (await client.stream(8))[0]["error"]


async def engine_idle(lmtp_server: LmtpServer) -> None:
    for _ in range(100):
        if lmtp_server.engine.num_unfinished_requests() == 0:
            return
        await asyncio.sleep(0.05)
    assert lmtp_server.engine.num_unfinished_requests() == 0


SCORE_LINE = "SCORE " + json.dumps({"model": "tiny", "prompt": PROMPT, "scored": [300, 301, 302], "stream_id": 43})


@pytest.mark.parametrize("when", ["same frame", "next frame"])
async def test_cancel_before_the_first_token_ends_the_stream_at_once(
    lmtp_server: LmtpServer, connect, when: str
) -> None:
    """A CANCEL that reaches the server before its stream's first token (in the GENERATE's own
    frame, or the frame after it) ends that stream with "cancelled" instead of being dropped."""
    client = await connect()
    await client.send(generate(40, max_tokens=64))  # a neighbour on the same connection
    await asyncio.wait_for(client.streams.setdefault(40, asyncio.Queue()).get(), 30)
    lines = [generate(41, max_tokens=500), 'CANCEL {"stream_id": 41}']
    if when == "same frame":  # a SCORE too: the frame is read whole before any stream starts
        await client.send("\n".join([*lines, SCORE_LINE, 'CANCEL {"stream_id": 43}']))
    else:
        for line in lines:
            await client.send(line)
    started = asyncio.get_running_loop().time()
    cancelled = await client.stream(41, timeout=30)
    elapsed = asyncio.get_running_loop().time() - started
    assert cancelled[-1]["finish_reason"] == "cancelled" and "error" not in cancelled[-1]
    assert len([p for p in cancelled if "token" in p]) <= 2, f"{len(cancelled)} payloads in {elapsed:.2f}s"
    if when == "same frame":  # never started: nothing went out before the end
        score = await client.stream(43, timeout=30)
        for payloads in (cancelled, score):
            assert len(payloads) == 1 and "token" not in payloads[0] and payloads[0]["finish_reason"] == "cancelled"
    neighbour = await client.stream(40)
    assert len(neighbour) == 63 and neighbour[-1]["finish_reason"] == "length"
    await engine_idle(lmtp_server)


@pytest.mark.parametrize(
    ("line", "stream_id", "message"),
    [
        (generate(20, prompt=[0, 10**6]), 20, "prompt[1] = 1000000 is not a token id"),
        (generate(21, prompt=[0, -4]), 21, "prompt[1] must be a non-negative integer"),
        (generate(22, model="gpt-5"), 22, "model 'gpt-5' is not served here"),
        (generate(23, prompt=[0] * 3000), 23, "exceed the model's context"),
        (generate(24, top_logprobs=100), 24, "top logprobs must be an integer in 0..20"),
        (generate(25, logit_bias={"1": "x"}), 25, "logit_bias[1] must be a number"),
        (generate(26, temprature=2), 26, "unknown field 'temprature'"),
        ('GENERATE {"stream_id": 27, "prompt": [0, 1', 27, "not valid JSON"),
        ("SCORE " + json.dumps({"stream_id": 28, "prompt": [0], "scored": [99999]}), 28, "continuation[0]"),
    ],
)
async def test_stream_errors_reach_their_stream_and_nothing_else(
    lmtp_server: LmtpServer, connect, line: str, stream_id: int, message: str
) -> None:
    client = await connect()
    await client.send(generate(99, max_tokens=40))
    await client.send(line)
    error = await client.stream(stream_id)
    assert len(error) == 1 and message in error[0]["error"]
    survivor = await client.stream(99)
    assert len(survivor) == 40 and survivor[-1]["finish_reason"] == "length"
    expected = await direct(lmtp_server, PROMPT, max_tokens=40, temperature=0.0)
    assert [p["token"] for p in survivor] == [e.token_id for e in expected]


@pytest.mark.parametrize(
    ("line", "message"),
    [("HELLO", "expected 'TYPE <json>'"), ("FROB {}", "unknown message type 'FROB'"), ("MODEL_INFO [", "not valid")],
)
async def test_connection_level_errors_come_as_msg(connect, line: str, message: str) -> None:
    client = await connect()
    await client.send(line)
    reply = await asyncio.wait_for(client.messages.get(), 10)
    assert message in reply["error"]
    await client.send(generate(1, max_tokens=2))
    assert len(await client.stream(1)) == 2


def oversized(stream_id: int, size: int) -> str:
    """A GENERATE of `size` bytes, stream_id last (where LMQL writes it)."""
    head, tail = 'GENERATE {"model": "tiny", "prompt": [', f'1], "stream_id": {stream_id}}}'
    count, spaces = divmod(size - len(head) - len(tail), 3)
    return head + "1, " * count + " " * spaces + tail


def errors(payloads: list[dict]) -> list[dict]:
    """Error payloads as {stream_id, error}, whatever else they carry."""
    return [{"stream_id": p["stream_id"], "error": p["error"]} for p in payloads]


async def test_an_oversized_message_costs_only_itself(lmtp_server: LmtpServer, connect) -> None:
    """A 20 MB GENERATE (over the 16 MiB message limit, under the 256 MiB frame ceiling) gets
    its stream's error; the stream running beside it and the connection carry on."""
    client = await connect()
    await client.send(generate(60, max_tokens=64))
    first = await asyncio.wait_for(client.streams.setdefault(60, asyncio.Queue()).get(), 30)
    big = oversized(61, 20 * 2**20)
    await client.send(big)
    error = await client.stream(61, timeout=30)
    limit = 16 * 2**20
    message = f"GENERATE message of {len(big)} bytes exceeds the limit of {limit} bytes (--lmtp-max-message-bytes)"
    assert errors(error) == [{"stream_id": 61, "error": message}]
    survivor = [first, *await client.stream(60)]
    assert len(survivor) == 64 and survivor[-1]["finish_reason"] == "length"
    expected = await direct(lmtp_server, PROMPT, max_tokens=64, temperature=0.0)
    assert [p["token"] for p in survivor] == [e.token_id for e in expected]
    await client.send(generate(62, max_tokens=3))
    assert len(await client.stream(62)) == 3

    reader, writer = await asyncio.open_connection("127.0.0.1", lmtp_server.tcp_port, limit=2**20)
    writer.write((generate(63, max_tokens=64) + "\n" + big + "\n" + generate(64, max_tokens=3) + "\n").encode())
    await writer.drain()
    payloads: dict[int, list] = {}
    while len(payloads.get(63, [])) < 64 or len(payloads.get(64, [])) < 3 or 61 not in payloads:
        kind, replies = parse_server_line((await asyncio.wait_for(reader.readline(), 30)).decode())
        assert kind == "TOKEN"
        for payload in replies:
            payloads.setdefault(payload["stream_id"], []).append(payload)
    writer.close()
    assert errors(payloads[61]) == [{"stream_id": 61, "error": message}]
    assert [p["token"] for p in payloads[63]] == [e.token_id for e in expected]


CEILING = 2**20
CEILING_ERROR = f"message exceeds the hard limit of {CEILING} bytes (--lmtp-max-frame-bytes); closing"


@contextlib.asynccontextmanager
async def small_limits(lmtp_server: LmtpServer) -> AsyncIterator[tuple[str, int]]:
    """A WebSocket URL and a TCP port on the tiny engine, with a 64 KiB message limit and a 1 MiB ceiling."""
    status = ServerStatus("tiny")
    status.ready(lmtp_server.engine)
    config = LmtpConfig(limits=ConnectionLimits(max_message_bytes=64 * 1024, max_frame_bytes=CEILING))
    runner = web.AppRunner(make_app(status, config, lmtp_server.sessions))
    await runner.setup()
    port, tcp_port = free_port(), free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    tcp = await start_tcp_server(status, config, lmtp_server.sessions, "127.0.0.1", tcp_port)
    try:
        yield f"http://127.0.0.1:{port}/", tcp_port
    finally:
        tcp.close()
        await runner.cleanup()


async def past_the_ceiling_over_tcp(tcp_port: int, line: str) -> None:
    """The MSG error for the line, then EOF (not a reset)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
    try:
        writer.write((line + "\n").encode())
        kind, payloads = parse_server_line((await asyncio.wait_for(reader.readline(), 10)).decode())
        assert (kind, errors(payloads)) == ("MSG", [{"stream_id": None, "error": CEILING_ERROR}])
        assert await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()


async def test_past_the_frame_ceiling_the_connection_closes(lmtp_server: LmtpServer) -> None:
    """Between the message limit and the frame ceiling: a stream error. Past the ceiling: the
    WebSocket closes with 1009; the TCP connection closes after a MSG error."""
    between = "GENERATE message of 102400 bytes exceeds the limit of 65536 bytes (--lmtp-max-message-bytes)"
    async with small_limits(lmtp_server) as (url, tcp_port):
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            await ws.send_str(oversized(1, 100 * 1024))
            kind, payloads = parse_server_line((await ws.receive(10)).data)
            assert (kind, errors(payloads)) == ("TOKEN", [{"stream_id": 1, "error": between}])
            await ws.send_str(oversized(2, CEILING + 1))
            closing = await ws.receive(10)
            assert closing.type is aiohttp.WSMsgType.CLOSE and closing.data == WSCloseCode.MESSAGE_TOO_BIG

        reader, writer = await asyncio.open_connection("127.0.0.1", tcp_port)
        writer.write((oversized(1, 100 * 1024) + "\n").encode())
        kind, payloads = parse_server_line((await asyncio.wait_for(reader.readline(), 10)).decode())
        assert (kind, errors(payloads)) == ("TOKEN", [{"stream_id": 1, "error": between}])
        writer.close()
        await past_the_ceiling_over_tcp(tcp_port, oversized(2, CEILING + 1))


async def test_every_frame_past_the_ceiling_reaches_the_client_as_its_close(lmtp_server: LmtpServer) -> None:
    """The rest of an oversized frame is still arriving when the server closes; closing a socket
    with unread data sends a reset, which discards the close frame (or the MSG error) before the
    client reads it: 1006 instead of 1009. The server reads the rest before closing, so every
    one arrives, just past the ceiling and far past it, each on a fresh connection."""
    async with small_limits(lmtp_server) as (url, tcp_port), aiohttp.ClientSession() as http:
        for size in [CEILING + 1, 8 * CEILING] * 20:
            frame = oversized(2, size)
            async with http.ws_connect(url) as ws:
                await ws.send_str(frame)
                closing = await ws.receive(10)
                assert (closing.type, closing.data) == (aiohttp.WSMsgType.CLOSE, WSCloseCode.MESSAGE_TOO_BIG), size
            await past_the_ceiling_over_tcp(tcp_port, frame)


async def test_reused_stream_id_is_an_error_for_that_id_only(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(generate(30, max_tokens=60))
    await client.send(generate(30, max_tokens=5))
    await client.send(generate(31, max_tokens=5))
    payloads = await client.stream(30)
    assert "already running" in payloads[-1]["error"]
    assert len(await client.stream(31)) == 5
    rest = await client.stream(30)
    assert len(payloads) - 1 + len(rest) == 60 and rest[-1]["finish_reason"] == "length"


async def test_fifty_streams_over_five_connections(lmtp_server: LmtpServer, connect) -> None:
    clients = [await connect() for _ in range(5)]
    prompts = {key: [0, *range(100 + 3 * key, 110 + 3 * key)] for key in range(50)}
    for c, client in enumerate(clients):
        for s in range(10):
            await client.send(generate(s, prompt=prompts[c * 10 + s], max_tokens=16))
    results = await asyncio.gather(*(client.stream(s) for client in clients for s in range(10)))
    for key, payloads in zip(sorted(prompts), results, strict=True):
        expected = await direct(lmtp_server, prompts[key], max_tokens=16, temperature=0.0)
        assert [p["token"] for p in payloads] == [e.token_id for e in expected]
        assert [p["finish_reason"] for p in payloads][-1] == "length"
    assert any(len({p["stream_id"] for p in payloads}) > 1 for client in clients for _, payloads in client.frames)


async def test_disconnect_aborts_every_running_request(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    for s in range(6):
        await client.send(generate(s, max_tokens=1500))
    await asyncio.wait_for(client.streams.setdefault(5, asyncio.Queue()).get(), 30)
    assert lmtp_server.engine.num_unfinished_requests() == 6
    await client.ws.close()
    for _ in range(100):
        if lmtp_server.engine.num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert lmtp_server.engine.num_unfinished_requests() == 0


async def test_plain_tcp_transport(lmtp_server: LmtpServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", lmtp_server.tcp_port)
    writer.write((generate(1, max_tokens=5) + "\nFROB {}\n").encode())
    await writer.drain()
    tokens, errors = [], []
    while len(tokens) < 5 or not errors:
        kind, _, body = (await asyncio.wait_for(reader.readline(), 30)).decode().partition(" ")
        for payload in json.loads(body):
            (tokens if kind == "TOKEN" else errors).append(payload)
    writer.close()
    expected = await direct(lmtp_server, PROMPT, max_tokens=5, temperature=0.0)
    assert [p["token"] for p in tokens] == [e.token_id for e in expected]
    assert "unknown message type" in errors[0]["error"]
