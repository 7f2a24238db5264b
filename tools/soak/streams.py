"""Valid LMTP streams (GENERATE greedy, sampled, text, readouts; SCORE) and a CANCEL at every moment."""

from __future__ import annotations

import asyncio
import random
import secrets

from tools.soak.connection import Connection, Received, line, receive
from tools.soak.state import Soak


def generate_fields(soak: Soak, rng: random.Random, prompt: list[int], max_tokens: int, *, sampled: bool) -> dict:
    fields: dict = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    fields["top_logprobs"] = rng.choice([0, 1, 5])
    if sampled:
        fields |= {"temperature": 0.9, "top_p": rng.choice([0.9, 1.0]), "top_k": rng.choice([0, 40])}
        if rng.random() < 0.5:
            fields["seed"] = rng.randrange(2**31)
    else:
        fields["temperature"] = 0.0
    if rng.random() < 0.5:
        fields["model"] = soak.model.name
    if rng.random() < 0.5:
        fields["request_id"] = f"soak-{secrets.token_hex(6)}"
    return fields


async def valid_generate(soak: Soak, conn: Connection, rng: random.Random, kind: str) -> None:
    prompt = soak.model.prompt(rng)
    sampled = kind == "generate/sampled" or (kind != "generate/greedy" and rng.random() < 0.5)
    fields = generate_fields(soak, rng, prompt, soak.tokens, sampled=sampled)
    text = kind == "generate/text"
    readout = kind == "generate/readout"
    if text:
        fields["text"] = True
    if readout:
        fields["readout"] = [[0, len(prompt) + soak.tokens]]
    stream_id = conn.next_stream_id()
    queue = conn.route(stream_id)
    soak.tally.start(kind)
    sent = asyncio.get_running_loop().time()
    try:
        await conn.send(line("GENERATE", {"stream_id": stream_id, **fields}))
        got = await receive(queue, soak.timeout)
    finally:
        conn.unroute(stream_id)
    why = got.trouble(soak.timeout) or check_generated(got, soak.tokens) or check_request_id(got, fields)
    if why is None and readout:
        why = check_readouts(got, len(prompt), soak.model.readout_width)
    if why is None and text and not all(isinstance(p.get("text"), str) for p in got.tokens):
        why = "a text-mode payload without text"
    settle(soak, kind, got, why)
    if why is None and not readout and got.first_token is not None:
        soak.tally.ttft_loaded.append(got.first_token - sent)


def check_request_id(got: Received, fields: dict) -> str | None:
    """The terminal payload names the stream's request id: the one the request gave, if any."""
    if not got.request_id or got.request_id != fields.get("request_id", got.request_id):
        return f"terminal payload with request_id {got.request_id!r}, expected {fields.get('request_id', 'one')!r}"
    return None


def check_generated(got: Received, max_tokens: int) -> str | None:
    if got.finish != "length":
        return f"finish_reason {got.finish!r} after {len(got.tokens)} tokens, expected 'length'"
    if len(got.tokens) != max_tokens:
        return f"{len(got.tokens)} tokens, expected {max_tokens}"
    return None


def check_readouts(got: Received, prompt_len: int, width: int) -> str | None:
    if len(got.prompt) != prompt_len:
        return f"{len(got.prompt)} prompt payloads, expected {prompt_len}"
    bad = [p for p in got.prompt + got.tokens if len(p.get("readout") or ()) != width]
    return f"{len(bad)} payloads without a {width}-float readout" if bad else None


def settle(soak: Soak, kind: str, got: Received, why: str | None) -> None:
    if why is None:
        soak.tally.complete(kind, len(got.tokens))
        return
    soak.tally.lose(kind, why, len(got.tokens))
    if got.ended == "error":
        soak.tally.unexpected[got.errors[-1][1][:70]] += 1


async def valid_score(soak: Soak, conn: Connection, rng: random.Random) -> None:
    prompt, scored = soak.model.prompt(rng), soak.model.prompt(rng, 1, 16)
    fields: dict = {"prompt": prompt, "scored": scored, "top_logprobs": rng.choice([0, 0, 3])}
    readout = soak.model.readout_width and rng.random() < 0.3
    if readout:
        fields["readout"] = [[0, len(prompt) + len(scored)]]
    stream_id = conn.next_stream_id()
    queue = conn.route(stream_id)
    soak.tally.start("score")
    try:
        await conn.send(line("SCORE", {"stream_id": stream_id, **fields}))
        got = await receive(queue, soak.timeout)
    finally:
        conn.unroute(stream_id)
    why = got.trouble(soak.timeout) or check_request_id(got, fields)
    if why is None and [p["token"] for p in got.tokens] != scored:
        why = f"scored tokens {[p['token'] for p in got.tokens][:8]}..., expected {scored[:8]}..."
    if why is None and got.finish != "length":
        why = f"finish_reason {got.finish!r}, expected 'length'"
    if why is None and not all(p["logprob"] <= 1e-4 for p in got.tokens):
        why = "a logprob above 0"
    if why is None and readout:
        why = check_readouts(got, len(prompt), soak.model.readout_width)
    settle(soak, "score", got, why)


CANCEL_MOMENTS = ("same-frame", "next-frame", "mid-stream", "after-end")


# ---- CANCEL at every moment ---------------------------------------------------------------------


# How long a CANCEL may take to end its stream, counted from when it went out to when the end
# arrived. Not a count of tokens: tokens the server sent before it read the CANCEL reach this
# busy process late, a dozen of them when it falls behind the tiny model, so token arrivals
# cannot tell a slow reader from a server that ignored the CANCEL. The server's answer does:
# "cancelled", or "not running" when the stream's end was already on its way.
CANCEL_SECONDS = 5.0


async def cancel_job(soak: Soak, conn: Connection, rng: random.Random, moment: str) -> None:
    """A long stream and a CANCEL in the same frame, the next frame, mid-stream, or after its end."""
    kind = f"cancel/{moment}"
    max_tokens = soak.tokens if moment == "after-end" else soak.long_tokens
    fields = generate_fields(soak, rng, soak.model.prompt(rng), max_tokens, sampled=rng.random() < 0.3)
    stream_id = conn.next_stream_id()
    generate, cancel = line("GENERATE", {"stream_id": stream_id, **fields}), line("CANCEL", {"stream_id": stream_id})
    queue = conn.route(stream_id)
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []  # when the CANCEL went out
    at = rng.randint(1, max(1, max_tokens // 4))

    async def cancel_mid(count: int) -> None:
        if count == at and not sent_at:
            await conn.send(cancel)
            sent_at.append(loop.time())

    soak.tally.start(kind)
    try:
        await (conn.send(generate, cancel) if moment == "same-frame" else conn.send(generate))
        if moment == "next-frame":
            await conn.send(cancel)
        if moment in ("same-frame", "next-frame"):
            sent_at.append(loop.time())
        got = await receive(queue, soak.timeout, on_token=cancel_mid if moment == "mid-stream" else None)
        why = got.trouble(soak.timeout)
        if why is None and moment == "after-end":
            why = check_generated(got, max_tokens) or await cancel_after_end(soak, conn, queue, cancel)
        elif why is None:
            why = check_cancelled(got, max_tokens, sent_at[0] if sent_at else None)
            if why is None and got.finish == "length":  # the end was on its way: the server says so
                why = await told_not_running(soak, queue, "CANCEL that met the stream's end")
    finally:
        conn.unroute(stream_id)
    settle(soak, kind, got, why)


def check_cancelled(got: Received, max_tokens: int, sent_at: float | None) -> str | None:
    """Ended "cancelled" within CANCEL_SECONDS of the CANCEL, or, when the end was already on
    its way, "length" with max_tokens (the caller then wants the server's "not running")."""
    if sent_at is None:
        return f"no CANCEL was sent: the stream ended {got.finish!r} after {len(got.tokens)} tokens"
    after = sum(1 for arrived in got.arrivals if arrived > sent_at)
    took = (got.finished_at or sent_at) - sent_at
    ended = got.finish == "cancelled" or (got.finish == "length" and len(got.tokens) == max_tokens)
    if ended and took <= CANCEL_SECONDS:
        return None
    return (
        f"the stream ended {got.finish!r} {took:.1f} s after the CANCEL went out, "
        f"after {len(got.tokens)} of {max_tokens} tokens ({after} arriving after the CANCEL)"
    )


async def cancel_after_end(soak: Soak, conn: Connection, queue: asyncio.Queue, cancel: str) -> str | None:
    """A CANCEL for a stream that has ended: the error that it is not running, and nothing else."""
    await conn.send(cancel)
    return await told_not_running(soak, queue, "CANCEL after the end")


async def told_not_running(soak: Soak, queue: asyncio.Queue, what: str) -> str | None:
    """The answer to a CANCEL that came too late to act on: "stream N is not running"."""
    late = await receive(queue, soak.timeout)
    if late.ended == "error" and "is not running" in late.errors[-1][1]:
        return None
    return f"{what}: {late.trouble(soak.timeout) or f'a payload ending {late.finish!r}'}"
