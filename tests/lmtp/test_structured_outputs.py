"""`structured_outputs` on LMTP's GENERATE and SESSION_GENERATE, over a real socket on the tiny
model: the stream's text matches, the session keeps the constrained tokens, and a constraint the
backend refuses is that stream's error, naming the field, while another stream runs on, and
one slow to validate holds up neither the other streams nor the server."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import aiohttp
import pytest

from tests.lmtp.conftest import LmtpServer

PROMPT = [0, *range(40, 60)]
OWNER = "anonymous@127.0.0.1"  # the open server's client from this address


def line(kind: str, **body) -> str:
    return f"{kind} {json.dumps(body)}"


async def test_generate_and_a_session_turn_follow_their_constraint(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    regex = {"regex": "[0-9]{4}-[a-z]{3}"}
    await client.send(
        line(
            "GENERATE", stream_id=1, prompt=PROMPT, max_tokens=20, temperature=1.0, text=True, structured_outputs=regex
        )
    )
    payloads = await client.stream(1)
    assert payloads[-1]["finish_reason"] == "stop"
    assert re.fullmatch(r"[0-9]{4}-[a-z]{3}<\|endoftext\|>", "".join(p["text"] for p in payloads))

    await client.send(line("OPEN_SESSION", stream_id=2, model="tiny"))
    sid = (await client.messages.get())["session_id"]
    choice = {"choice": ["red", "green", "blue"]}
    turn = line(
        "SESSION_GENERATE",
        stream_id=3,
        session_id=sid,
        offset=0,
        append=PROMPT,
        max_tokens=10,
        structured_outputs=choice,
    )
    await client.send(turn)
    payloads = await client.stream(3)
    generated = [p["token"] for p in payloads if "token" in p]
    assert payloads[-1]["finish_reason"] == "stop"
    assert lmtp_server.engine.tokenizer.decode(generated[:-1]) in choice["choice"]
    assert lmtp_server.sessions.tokens(sid, OWNER) == PROMPT + generated


async def test_a_refused_constraint_is_its_streams_error_while_another_runs(lmtp_server: LmtpServer, connect) -> None:
    client = await connect()
    await client.send(line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=300, temperature=0.0, ignore_eos=True))
    await client.send(line("GENERATE", stream_id=2, prompt=PROMPT, structured_outputs={"regex": "[0-9"}))
    await client.send(line("GENERATE", stream_id=3, prompt=PROMPT, structured_outputs={"json": {"type": "nonsense"}}))
    await client.send(line("GENERATE", stream_id=4, prompt=PROMPT, structured_outputs={"regex": "a", "choice": ["b"]}))
    field_monitor = {"concept": "c", "above": 0.5, "action": "stop", "path": "$.city"}  # needs a JSON reply
    await client.send(line("GENERATE", stream_id=5, prompt=PROMPT, monitors=[field_monitor]))
    assert (await client.stream(5))[0]["error"].startswith("monitors[0].path watches a field of a JSON reply")
    assert (await client.stream(2))[0]["error"].startswith("structured_outputs.regex: Grammar error")
    assert (await client.stream(3))[0]["error"].startswith("structured_outputs.json: Grammar error: Invalid type")
    assert "structured_outputs must hold exactly one of" in (await client.stream(4))[0]["error"]
    running = await client.stream(1)
    assert len(running) == 300 and running[-1]["finish_reason"] == "length"


async def test_a_constraint_slow_to_validate_holds_up_no_other_stream(
    lmtp_server: LmtpServer, connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = lmtp_server.engine.checks.constraints
    verify, entered, release = backend._verify, threading.Event(), threading.Event()

    def slow(c):  # a large schema's parse, held until the server has shown it is not waiting on it
        entered.set()
        release.wait(120)
        return verify(c)

    monkeypatch.setattr(backend, "_verify", slow)
    client = await connect()
    regex = {"regex": "[0-9]{5}-held"}
    await client.send(line("GENERATE", stream_id=2, prompt=PROMPT, max_tokens=20, text=True, structured_outputs=regex))
    await asyncio.to_thread(entered.wait, 120)
    await client.send(line("GENERATE", stream_id=1, prompt=PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True))
    async with aiohttp.ClientSession() as http, http.get(f"{lmtp_server.url}health") as health:
        assert health.status == 200
    running = await client.stream(1)  # started and finished while the other was being validated
    assert len(running) == 40 and running[-1]["finish_reason"] == "length"
    assert 2 not in client.streams and not release.is_set()  # nothing of it yet
    release.set()
    held = await client.stream(2)
    assert held[-1]["finish_reason"] == "stop" and re.fullmatch(r"[0-9]{5}-held", "".join(p["text"] for p in held[:-1]))
