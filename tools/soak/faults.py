"""Bad LMTP inputs, each with the error it must get, and connections dropped or overfilled by the client."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from tools.soak.connection import Connection, Received, line, receive
from tools.soak.state import Soak
from tools.soak.streams import check_generated, generate_fields, settle

BAD_INPUTS = (
    "not-json",
    "garbage-line",
    "unknown-type",
    "bad-field-type",
    "bad-stream-id",
    "unknown-field",
    "unknown-model",
    "cancel-unknown-stream",
    "token-out-of-range",
    "context-overflow",
    "oversized",
)


@dataclass(frozen=True)
class BadInput:
    """A line (or a whole frame) and the error it must get."""

    lines: tuple[str, ...]
    expect: tuple[str, ...]  # substrings the error must hold
    stream_id: int | None  # None: a MSG error without a stream_id
    channels: tuple[str, ...] = ("TOKEN",)  # frame types the error may come in


def bad_input(soak: Soak, conn: Connection, rng: random.Random, kind: str) -> BadInput:
    sid = conn.next_stream_id()
    vocab, prompt = soak.model.vocab_size, soak.model.prompt(rng, 2, 8)
    match kind:
        case "not-json":
            return BadInput((f'GENERATE {{"stream_id": {sid}, "prompt": [1, 2',), ("body is not valid JSON",), sid)
        case "garbage-line":
            return BadInput(("HELLO-THERE",), ("expected 'TYPE <json>'",), None, ("MSG",))
        case "unknown-type":
            return BadInput(
                (line("FROBNICATE", {"stream_id": sid}),), ("unknown message type 'FROBNICATE'",), None, ("MSG",)
            )
        case "bad-field-type":
            field_name, value, expect = rng.choice(
                [
                    ("prompt", "hello", "prompt must be a list of token ids"),
                    ("max_tokens", "16", "max_tokens must be an integer"),
                    ("temperature", "hot", "temperature must be a number"),
                    ("ignore_eos", 1, "ignore_eos must be true or false"),
                ]
            )
            fields = {"stream_id": sid, "prompt": prompt, field_name: value}
            return BadInput((line("GENERATE", fields),), (expect,), sid)
        case "bad-stream-id":
            fields = {"stream_id": "seven", "prompt": prompt}
            return BadInput((line("GENERATE", fields),), ("stream_id must be an integer",), None, ("MSG",))
        case "unknown-field":
            fields = {"stream_id": sid, "prompt": prompt, "max_token": 4}
            return BadInput((line("GENERATE", fields),), ("unknown field 'max_token'",), sid)
        case "unknown-model":
            fields = {"stream_id": sid, "prompt": prompt, "model": "no-such-model"}
            return BadInput((line("GENERATE", fields),), ("'no-such-model' is not served here",), sid)
        case "cancel-unknown-stream":
            return BadInput(
                (line("CANCEL", {"stream_id": sid}),), (f"stream {sid} is not running",), sid, ("TOKEN", "MSG")
            )
        case "token-out-of-range":
            bad = vocab + rng.randrange(1000)
            if rng.random() < 0.5:
                fields = {"stream_id": sid, "prompt": [*prompt, bad], "max_tokens": 2}
                return BadInput((line("GENERATE", fields),), (f"= {bad} is not a token id of this model",), sid)
            fields = {"stream_id": sid, "prompt": prompt, "scored": [bad]}
            return BadInput((line("SCORE", fields),), (f"continuation[0] = {bad} is not a token id",), sid)
        case "context-overflow":
            fields = {"stream_id": sid, "prompt": prompt, "max_tokens": soak.model.max_model_len}
            return BadInput((line("GENERATE", fields),), ("exceed the model's context",), sid)
        case "oversized":
            return BadInput((oversized_generate(sid, soak.server.max_message_bytes),), OVERSIZED, sid)
    raise ValueError(kind)


OVERSIZED = ("exceeds the limit of", "--lmtp-max-message-bytes")


def oversized_generate(stream_id: int, limit: int) -> str:
    """A GENERATE a little over the limit: a prompt of ~limit/2 token ids, stream_id first."""
    head = f'GENERATE {{"stream_id": {stream_id}, "max_tokens": 1, "prompt": [1'
    return head + ",7" * ((limit - len(head)) // 2 + 1024) + "]}"


async def bad_input_job(soak: Soak, conn: Connection, rng: random.Random, kind: str) -> None:
    bad = bad_input(soak, conn, rng, kind)
    if bad.stream_id is None:
        async with conn.anonymous_lock:
            await conn.send(*bad.lines)
            got = await receive(conn.anonymous, soak.timeout)
    else:
        queue = conn.route(bad.stream_id)
        try:
            await conn.send(*bad.lines)
            got = await receive(queue, soak.timeout)
        finally:
            conn.unroute(bad.stream_id)
    judge_bad_input(soak, kind, bad, got)


def judge_bad_input(soak: Soak, kind: str, bad: BadInput, got: Received) -> None:
    if got.ended in ("timeout", "dropped"):
        soak.tally.fault(kind, "unanswered", got.trouble(soak.timeout) or "")
    elif got.ended != "error":
        soak.tally.fault(kind, "wrong", f"no error: the stream ended {got.finish!r} after {len(got.tokens)} tokens")
    else:
        channel, message = got.errors[-1]
        if got.unnamed_errors:
            soak.tally.fault(kind, "wrong", f"{channel} error {message!r} without a request_id")
        elif channel in bad.channels and all(part in message for part in bad.expect):
            soak.tally.fault(kind, "specific")
        else:
            soak.tally.fault(kind, "wrong", f"{channel} error {message!r}, expected {bad.channels} with {bad.expect}")


async def duplicate_stream_id(soak: Soak, conn: Connection, rng: random.Random) -> None:
    """A GENERATE reusing a running stream's id: an error for that id; the running stream carries on.

    The duplicate goes out when the carrier's first token arrives. If the carrier had ended
    before the duplicate reached the server (this side fell behind: the carrier's last token can
    be waiting unread in the socket), the id was free again and the duplicate runs as a stream
    of its own, after the carrier's end on the connection: then only that stream is checked, and
    nothing is tallied. (A server that let a duplicate run beside its carrier would mix the two
    streams, and the carrier's check fails.)"""
    kind = "duplicate-stream-id"
    fields = generate_fields(soak, rng, soak.model.prompt(rng), soak.long_tokens, sampled=False)
    stream_id = conn.next_stream_id()
    queue = conn.route(stream_id)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    duplicate_errors: list[str] = []

    async def reuse(count: int) -> None:
        if count == 1:
            again = generate_fields(soak, rng, [5], 2, sampled=False)
            await conn.send(line("GENERATE", {"stream_id": stream_id, **again}))
            sent_at.append(loop.time())

    def duplicate_error(error: str) -> bool:
        """The one error the duplicate earns does not end the carrier."""
        if "already running" in error and not duplicate_errors:
            duplicate_errors.append(error)
            return True
        return False

    soak.tally.start("generate/carrier")
    try:
        await conn.send(line("GENERATE", {"stream_id": stream_id, **fields}))
        got = await receive(queue, soak.timeout, on_token=reuse, tolerate=duplicate_error)
        raced = bool(sent_at and not duplicate_errors and got.finish is not None)
        second = await receive(queue, soak.timeout) if raced else None
    finally:
        conn.unroute(stream_id)
    # The carrier is a valid stream, whatever the duplicate got.
    settle(soak, "generate/carrier", got, got.trouble(soak.timeout) or check_generated(got, soak.long_tokens))
    if second is not None:
        if second.trouble(soak.timeout) or check_generated(second, 2):
            soak.tally.fault(
                kind, "wrong", f"sent after the carrier ended, it got {second.trouble(soak.timeout) or second.finish}"
            )
    elif not sent_at:
        soak.tally.fault(kind, "unanswered", "the carrier ended before its first token")
    elif duplicate_errors and f"stream_id {stream_id} is already running" in duplicate_errors[0]:
        soak.tally.fault(kind, "specific")
    else:
        soak.tally.fault(kind, "wrong", f"errors for the id: {[m for _, m in got.errors] or 'none'}")


# ---- connections dropped by the client mid-stream -------------------------------------------


async def disconnect_job(soak: Soak, rng: random.Random) -> None:
    """Open a connection, start streams, close the socket while they run (before or after tokens)."""
    kind = "disconnect"
    soak.tally.start(kind)
    conn = await Connection.open(soak.server.url, soak.options.auth_token, soak.server.context())
    try:
        queues = []
        for _ in range(rng.randint(1, 4)):
            stream_id = conn.next_stream_id()
            queues.append(conn.route(stream_id))
            fields = generate_fields(soak, rng, soak.model.prompt(rng), soak.long_tokens, sampled=rng.random() < 0.5)
            await conn.send(line("GENERATE", {"stream_id": stream_id, **fields}))
        if rng.random() < 0.7:  # else: close before any token
            item = await asyncio.wait_for(queues[0].get(), soak.timeout)
            if item is None or item[1].get("error") is not None:
                soak.tally.lose(kind, f"before the close: {item and item[1]} / {conn.dropped}")
                return
    except TimeoutError:
        soak.tally.lose(kind, f"no token within {soak.timeout:.0f} s")
        return
    finally:
        await conn.close()
    soak.tally.complete(kind, 0)


async def oversized_frame_job(soak: Soak) -> None:
    """A frame past --lmtp-max-frame-bytes is not read: the server closes with 1009 (message too big)."""
    conn = await Connection.open(soak.server.url, soak.options.auth_token, soak.server.context())
    try:
        await conn.send(oversized_generate(conn.next_stream_id(), soak.server.max_frame_bytes))
        closed = await conn.wait_closed(soak.timeout)
        if not closed:
            soak.tally.fault("oversized-frame", "unanswered", f"still open after {soak.timeout:.0f} s")
        elif conn.close_code != 1009 or conn.strays:
            got = f"close code {conn.close_code} after {[p for _, p, _ in conn.strays][:2]}"
            soak.tally.fault("oversized-frame", "wrong", f"{got}, expected 1009 and nothing before it")
        else:
            soak.tally.fault("oversized-frame", "specific")
    finally:
        await conn.close()
