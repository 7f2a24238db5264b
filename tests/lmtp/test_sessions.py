"""Sessions over LMTP: the same core sessions the gRPC service drives; and the bearer token."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from salience.auth import Tokens
from salience.core.serving.status import ServerStatus
from salience.grpc_frontend.client import AsyncSalienceClient, AsyncSession
from salience.grpc_frontend.server import start_grpc_server
from salience.http_app import make_app
from salience.lmtp.session import LmtpConfig
from salience.lmtp.websocket import AUTH_CLOSE_CODE
from tests.conftest import free_port
from tests.lmtp.conftest import LmtpServer
from tests.reference import Reference

PROMPT = [0, *range(50, 80)]
OWNER = "anonymous@127.0.0.1"  # whose the test's sessions are: the open server's client from this address


def line(kind: str, **body) -> str:
    return f"{kind} {json.dumps(body)}"


async def open_session(client) -> str:
    await client.send(line("OPEN_SESSION", stream_id=1, model="tiny"))
    reply = await client.messages.get()
    assert reply["max_model_len"] == 2048
    return reply["session_id"]


async def test_turns_send_only_new_tokens(lmtp_server: LmtpServer, connect, tiny_reference: Reference) -> None:
    client = await connect()
    sid = await open_session(client)
    await client.send(
        line("SESSION_GENERATE", stream_id=2, session_id=sid, offset=0, append=PROMPT, max_tokens=5, temperature=0.0)
    )
    payloads = await client.stream(2)
    greedy = tiny_reference.greedy(PROMPT, 5)
    assert [p["token"] for p in payloads[:-1]] == greedy
    assert [p["position"] for p in payloads[:-1]] == list(range(31, 36))
    assert all(set(p) == {"stream_id", "token", "position", "finish_reason"} for p in payloads[:-1])
    assert payloads[-1]["finish_reason"] == "length"
    usage = payloads[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (31, 5, 36)

    # Second turn: a delta, prefill-only, with logprobs over the new positions and text.
    await client.send(
        line(
            "SESSION_GENERATE",
            stream_id=3,
            session_id=sid,
            offset=36,
            append=[7, 8],
            logprobs=[[36, 38]],
            top_logprobs=2,
        )
    )
    scored = await client.stream(3)
    ids = PROMPT + greedy + [7, 8]
    logprobs = tiny_reference.logprobs(ids)
    assert [(p["position"], p["prompt"]) for p in scored[:-1]] == [(36, True), (37, True)]
    for payload in scored[:-1]:
        assert payload["logprob"] == pytest.approx(logprobs[payload["position"] - 1, payload["token"]].item(), abs=1e-4)
        assert len(payload["top_logprobs"]) == 2
    assert lmtp_server.sessions.tokens(sid, OWNER) == ids

    await client.send(line("FORK_SESSION", stream_id=4, session_id=sid, at_position=31))
    fork = await client.messages.get()
    await client.send(line("DUMP_SESSION", stream_id=5, session_id=fork["session_id"]))
    assert (await client.messages.get())["tokens"] == PROMPT
    await client.send(line("CLOSE_SESSION", stream_id=6, session_id=sid))
    assert (await client.messages.get())["closed"] is True


async def test_session_errors_belong_to_their_stream(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    sid = await open_session(client)
    await client.send(line("SESSION_GENERATE", stream_id=2, session_id=sid, offset=4, append=[1]))
    assert (await client.stream(2))[0][
        "error"
    ] == "offset 4 does not match the session's length 0; set truncating to rewind to a shorter offset"
    await client.send(line("SESSION_GENERATE", stream_id=3, session_id="nope", offset=0))
    assert "no session 'nope'" in (await client.stream(3))[0]["error"]
    await client.send(line("SESSION_GENERATE", stream_id=4, session_id=sid))
    assert "missing field 'offset'" in (await client.stream(4))[0]["error"]
    await client.send(line("DUMP_SESSION", stream_id=5, session_id="nope"))
    assert "no session 'nope'" in (await client.messages.get())["error"]
    await client.send(line("OPEN_SESSION", stream_id=6, model="gpt-9"))
    assert "not served here" in (await client.messages.get())["error"]

    # Busy, then CANCEL: the turn ends "cancelled" and keeps what was streamed.
    await client.send(
        line("SESSION_GENERATE", stream_id=7, session_id=sid, offset=0, append=PROMPT, max_tokens=400, temperature=0.0)
    )
    first = await client.streams.setdefault(7, asyncio.Queue()).get()
    await client.send(line("SESSION_GENERATE", stream_id=8, session_id=sid, offset=31))
    assert "already generating" in (await client.stream(8))[0]["error"]
    await client.send(line("CANCEL", stream_id=7))
    rest = [first, *await client.stream(7)]
    assert rest[-1]["finish_reason"] == "cancelled"
    streamed = [p["token"] for p in rest if "token" in p]
    assert lmtp_server.sessions.tokens(sid, OWNER) == PROMPT + streamed
    assert rest[-1]["usage"]["completion_tokens"] == len(streamed)


@pytest.mark.parametrize("when", ["same frame", "next frame", "during setup"])
async def test_cancel_before_a_turns_first_token(lmtp_server: LmtpServer, connect, monkeypatch, when: str) -> None:
    """A turn cancelled before its first token (or while SessionStore.start still sets it up, as
    with images to decode) ends "cancelled" at once; its append is kept, as with any cancel."""
    if when == "during setup":
        start = lmtp_server.sessions.start

        async def slow_start(*args):
            await asyncio.sleep(0.3)  # like decoding an image in a thread
            return await start(*args)

        monkeypatch.setattr(lmtp_server.sessions, "start", slow_start)
    client = await connect()
    sid = await open_session(client)
    await client.send(line("GENERATE", stream_id=9, prompt=PROMPT, max_tokens=64, ignore_eos=True, temperature=0.0))
    turn = line("SESSION_GENERATE", stream_id=2, session_id=sid, offset=0, append=PROMPT, max_tokens=500, temperature=0)
    cancel = line("CANCEL", stream_id=2)
    if when == "same frame":
        await client.send(turn + "\n" + cancel)
    else:
        await client.send(turn)
        if when == "during setup":
            await asyncio.sleep(0.1)
        await client.send(cancel)
    payloads = await client.stream(2, timeout=30)
    assert payloads[-1]["finish_reason"] == "cancelled"
    streamed = [p["token"] for p in payloads if "token" in p]
    assert len(streamed) <= 2 and payloads[-1]["usage"]["completion_tokens"] == len(streamed)
    if when != "next frame":
        assert streamed == []
    assert lmtp_server.sessions.tokens(sid, OWNER) == PROMPT + streamed
    neighbour = await client.stream(9)
    assert len(neighbour) == 64 and neighbour[-1]["finish_reason"] == "length"
    for _ in range(100):
        if lmtp_server.engine.num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert lmtp_server.engine.num_unfinished_requests() == 0
    # The session is free for its next turn.
    await client.send(line("SESSION_GENERATE", stream_id=3, session_id=sid, offset=len(PROMPT) + len(streamed)))
    assert (await client.stream(3))[-1]["finish_reason"] == "length"


async def test_text_mode_in_a_session(lmtp_server: LmtpServer, connect) -> None:
    tokenizer = lmtp_server.engine.tokenizer
    client = await connect()
    sid = await open_session(client)
    await client.send(
        line(
            "SESSION_GENERATE",
            stream_id=2,
            session_id=sid,
            offset=0,
            append=PROMPT,
            max_tokens=6,
            temperature=0.0,
            text=True,
        )
    )
    payloads = await client.stream(2)
    tokens = [p["token"] for p in payloads[:-1]]
    assert "".join(p["text"] for p in payloads) == tokenizer.decode(PROMPT + tokens)[len(tokenizer.decode(PROMPT)) :]


async def test_both_frontends_drive_the_same_sessions(lmtp_server: LmtpServer, connect) -> None:
    grpc_server = await start_grpc_server(lmtp_server.status, lmtp_server.sessions, "127.0.0.1", 0)
    try:
        client = await connect()
        sid = await open_session(client)
        await client.send(line("SESSION_GENERATE", stream_id=2, session_id=sid, offset=0, append=PROMPT))
        await client.stream(2)
        async with AsyncSalienceClient(f"127.0.0.1:{grpc_server.port}") as rpc:
            shared = AsyncSession(rpc, sid, len(PROMPT))
            result = await shared.generate([5], max_tokens=2, top_k=1)
            assert await shared.dump() == [*PROMPT, 5, *result.token_ids]
        await client.send(line("DUMP_SESSION", stream_id=3, session_id=sid))
        assert len((await client.messages.get())["tokens"]) == len(PROMPT) + 3
    finally:
        await grpc_server.stop(0)


async def test_websocket_bearer_token(lmtp_server: LmtpServer) -> None:
    status = ServerStatus("tiny")
    status.ready(lmtp_server.engine)
    runner = web.AppRunner(make_app(status, LmtpConfig(tokens=Tokens("s3cret"))))
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/"
    try:
        async with aiohttp.ClientSession() as http:
            for target, headers in ((url, {}), (url + "?token=wrong", {}), (url, {"Authorization": "Bearer nope"})):
                async with http.ws_connect(target, headers=headers) as ws:
                    message = await ws.receive()
                    assert message.type is aiohttp.WSMsgType.CLOSE and message.data == AUTH_CLOSE_CODE
                    assert message.extra.startswith("unauthorized")
            for target, headers in ((url + "?token=s3cret", {}), (url, {"Authorization": "Bearer s3cret"})):
                async with http.ws_connect(target, headers=headers) as ws:
                    await ws.send_str(line("MODEL_INFO", stream_id=1))
                    reply = json.loads((await ws.receive()).data.partition(" ")[2])
                    assert reply[0]["model_info"]["model"] == "tiny"
            async with http.get(url + "health") as health:
                assert health.status == 200  # no token needed
    finally:
        await runner.cleanup()
