"""Session behaviour without a transport: flow control and system messages."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine

import pytest

from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.lmtp import streams
from salience.lmtp.session import ConnectionLimits, LmtpConfig, LmtpSession


def generate(stream_id: int, max_tokens: int = 1500) -> str:
    body = {"prompt": [0, 5, 6, 7], "stream_id": stream_id, "max_tokens": max_tokens, "ignore_eos": True}
    return "GENERATE " + json.dumps(body)


async def wait_until(condition, timeout: float = 30) -> None:
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def session_for(engine: Engine, limits: ConnectionLimits) -> LmtpSession:
    status = ServerStatus("tiny")
    status.ready(engine)
    return LmtpSession(status, LmtpConfig(limits=limits), SessionStore(status.serving_engine))


@contextlib.asynccontextmanager
async def pumping(session: LmtpSession, send: Callable[[str], Awaitable[None]]) -> AsyncIterator[asyncio.Task]:
    """The session's pump running, and the session closed after whatever the test found: one
    left open would hold the process-wide connection gauge that test_metrics reads."""
    pump = asyncio.create_task(session.pump(send))
    try:
        yield pump
    finally:
        session.close()
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)


async def test_a_client_that_never_reads_gets_its_streams_ended_and_the_engine_emptied(tiny_engine: Engine) -> None:
    session = session_for(tiny_engine, ConnectionLimits(max_pending=200, send_timeout=600))
    stuck = asyncio.Event()
    frames: list[str] = []

    async def send(frame: str) -> None:  # the first frame goes out, then the client stops reading
        frames.append(frame)
        await stuck.wait()

    async with pumping(session, send):
        for stream_id in range(4):
            session.receive(generate(stream_id))
        await asyncio.wait_for(session.closed.wait(), 60)
        await session.wait_closed()
        await wait_until(lambda: tiny_engine.num_unfinished_requests() == 0)
        queued = [payload for kind, payload in session._outbox._queue if kind == "TOKEN"]
        assert len(queued) <= 200 + 4  # bounded: the limit plus one error per stream
        errors = {p["stream_id"]: p["error"] for p in queued if "error" in p}
        assert set(errors) == {0, 1, 2, 3} and all("not reading" in e for e in errors.values())


async def test_a_frame_that_cannot_be_sent_in_time_closes_the_session(tiny_engine: Engine) -> None:
    session = session_for(tiny_engine, ConnectionLimits(max_pending=10**6, send_timeout=0.5))

    async def send(frame: str) -> None:
        await asyncio.Event().wait()

    async with pumping(session, send) as pump:
        session.receive(generate(1))
        await asyncio.wait_for(asyncio.shield(pump), 30)
        assert session.closed.is_set()
        await session.wait_closed()
        await wait_until(lambda: tiny_engine.num_unfinished_requests() == 0)


async def test_status_messages_follow_the_server_lifecycle(tiny_engine: Engine) -> None:
    status = ServerStatus("tiny")
    session = LmtpSession(status, LmtpConfig(), SessionStore(status.serving_engine))
    sent: list[str] = []

    async def send(frame: str) -> None:
        sent.append(frame)

    async with pumping(session, send) as pump:
        session.receive('STATUS {"stream_id": 9}')
        session.receive(generate(1, 4))  # while loading: a clear error, not a hang
        await wait_until(lambda: len(sent) >= 2)
        status.ready(tiny_engine)
        await wait_until(lambda: len(sent) >= 3)
        status.stopping()
        await wait_until(lambda: len(sent) >= 4)
        session.close()
        await asyncio.wait_for(asyncio.shield(pump), 5)  # closing ends the pump by itself
    messages = [json.loads(frame.partition(" ")[2]) for frame in sent]
    assert messages[0] == [{"stream_id": 9, "status": "loading", "model": "tiny"}]
    assert "still loading" in messages[1][0]["error"] and messages[1][0]["stream_id"] == 1
    assert messages[2] == [{"stream_id": 9, "status": "ready", "model": "tiny"}]
    assert messages[3] == [{"stream_id": 9, "status": "stopping", "model": "tiny"}]


async def test_a_stream_id_is_free_again_once_its_terminal_payload_is_out(tiny_engine: Engine) -> None:
    """A client may reuse an id as soon as it reads the stream's end, even while the old
    stream's task winds down; a CANCEL then reaches the new stream, not the old one's leftovers.
    The reuse here comes the moment the terminal payload is queued, from inside the old task:
    no client can be faster."""
    session = session_for(tiny_engine, ConnectionLimits())
    payloads: list[dict] = []
    put = session._outbox.put

    def put_then_reuse(kind: str, payload: dict) -> None:
        put(kind, payload)
        if payload.get("finish_reason") and len(payloads) == 0:
            payloads.append(payload)
            assert any(not stream.task.done() for stream in session._running._live)  # the old task runs on
            session.receive(generate(1))
            session.receive('CANCEL {"stream_id": 1}')
        elif payload.get("finish_reason") or "error" in payload:
            payloads.append(payload)

    session._outbox.put = put_then_reuse

    async def send(frame: str) -> None:
        pass

    async with pumping(session, send):
        session.receive(generate(1, 4))
        await wait_until(lambda: len(payloads) >= 2)
        await session.wait_closed()
    assert [p.get("finish_reason") for p in payloads] == ["length", "cancelled"], payloads
    assert payloads[0]["request_id"] != payloads[1]["request_id"]


async def test_a_cancel_that_meets_the_streams_end_is_told_it_is_not_running(tiny_engine: Engine) -> None:
    """The CANCEL arrives after the engine made the last token but before its payload goes
    out (the race a soak found once): the stream ends "length", then the CANCEL's answer."""
    session = session_for(tiny_engine, ConnectionLimits())
    payloads: list[dict] = []
    token, put = session._running._token, session._outbox.put

    def cancel_then_token(stream, payload: dict) -> None:
        if payload.get("finish_reason") and not stream.cancelled:
            session.receive('CANCEL {"stream_id": 1}')
        token(stream, payload)

    def record(kind: str, payload: dict) -> None:
        put(kind, payload)
        if payload.get("finish_reason") or "error" in payload:
            payloads.append(payload)

    session._running._token, session._outbox.put = cancel_then_token, record

    async def send(frame: str) -> None:
        pass

    async with pumping(session, send):
        session.receive(generate(1, 4))
        await wait_until(lambda: len(payloads) >= 2)
        await session.wait_closed()
    assert payloads[0]["finish_reason"] == "length"
    assert payloads[1]["error"] == "CANCEL: stream 1 is not running"
    assert payloads[1]["request_id"] == payloads[0]["request_id"]
    assert len(payloads) == 2


async def test_a_client_gone_before_its_streams_ran_leaves_no_coroutine_behind(
    tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The soak's dropped connections found it: a stream whose task is cancelled before it first
    runs must not leave a coroutine that was never awaited (Python reports it on stderr, past
    the structured logs, once it is collected), and must still end its admission (the active
    gauge and drain wait for it)."""
    made: list[Coroutine] = []
    for name in ("generate", "score"):
        monkeypatch.setattr(streams, name, keeping(getattr(streams, name), made))
    session = session_for(tiny_engine, ConnectionLimits())
    session.receive(generate(1))
    session.receive("SCORE " + json.dumps({"stream_id": 3, "prompt": [0, 5], "scored": [6, 7]}))
    assert len(session._running._live) == 2
    session.close()  # in the same tick: neither task has run
    await session.wait_closed()
    assert session._running.idle and len(session._running) == 0
    assert [inspect.getcoroutinestate(c) for c in made if inspect.getcoroutinestate(c) == "CORO_CREATED"] == []
    assert session._status.in_flight == 0


def keeping(function: Callable[..., Coroutine], made: list[Coroutine]) -> Callable[..., Coroutine]:
    """`function`, each coroutine it makes kept in `made`."""

    def make(*args, **kwargs) -> Coroutine:
        made.append(function(*args, **kwargs))
        return made[-1]

    return make
