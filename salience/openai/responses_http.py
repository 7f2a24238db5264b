"""`POST /v1/responses` run on the chat path and answered, whole or as a stream of events.

The app (app.py) reads the request, checks its model and scopes and admits it, as for chat; here
the earlier items of `previous_response_id` join the conversation, a stored response's session is
reserved (response_store.py), the chat path runs it (run.py, the same Run as
`/v1/chat/completions`), and the response goes out (response_events.py) and is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from salience.auth import Client
from salience.core.engine.chat_messages import ChatMessage
from salience.core.serving.status import Admitted
from salience.openai.errors import ApiError, naming
from salience.openai.response_events import Events, ResponseObject, reply_of
from salience.openai.response_store import PREFIX, ResponseStore, Stored
from salience.openai.responses import Collected
from salience.openai.responses_api import ResponsesRequest, check_outputs
from salience.openai.run import Run

__all__ = ["Exchange", "answer"]


@dataclass(frozen=True)
class Exchange:
    """What the app knows of the HTTP request: its id, client and headers, and how an error that
    comes once a stream is out is reported (logged, counted, as OpenAI's object)."""

    request: web.Request
    request_id: str
    client: Client
    model: str  # the served name, as responses carry it
    headers: dict[str, str]
    fail: Callable[[Exception], ApiError]


async def answer(
    exchange: Exchange, ask: ResponsesRequest, store: ResponseStore, admitted: Admitted
) -> web.StreamResponse:
    """Run `ask` (admitted) and answer it; keep it first when it asked to be stored."""
    client = exchange.client
    history: tuple[ChatMessage, ...] = ()
    if ask.previous_response_id is not None:
        with naming("previous_response_id"):
            history = store.find(ask.previous_response_id, client).history
    check_outputs(ask, history)
    messages = ask.messages(history)
    engine = admitted.engine
    with naming("input"):
        prompt = await engine.chat.prompt(messages, [tool.as_json() for tool in ask.chat.tools] or None)
    with naming():
        response_id = store.reserve(client) if ask.store else PREFIX + exchange.request_id
    reply = ResponseObject(response_id, int(time.time()), exchange.model, ask.echo)
    kept = False

    def keep(collected: Collected, body: dict) -> None:
        """Store the ended response `body` (of `collected`), if asked, before it goes out."""
        nonlocal kept
        if ask.store:
            text, calls = reply_of(collected)
            said = ChatMessage(role="assistant", content=text or "", tool_calls=calls)
            tokens = [*prompt.tokens, *(event.token_id for event in collected.events)]
            stored = Stored(body, (*history, *ask.input, said))
            with naming():
                store.keep(response_id, client, (*messages, said), tokens, len(prompt.tokens), stored)
            kept = True

    try:
        run = await Run.start(
            engine, dataclasses.replace(ask.chat, messages=messages), [prompt], exchange.request_id, client
        )
        try:
            reply.layout = run.layout
            if ask.chat.stream:
                return await _stream(exchange, reply, run, admitted, keep)
            collected = Collected(0)
            async with contextlib.aclosing(run.steps()) as steps:
                async for _, step in steps:
                    collected.add(step)
            body = reply.whole(collected, run.usage())
            keep(collected, body)
            admitted.end(collected.finish or "cancelled")
            return web.Response(body=orjson.dumps(body), content_type="application/json", headers=exchange.headers)
        finally:
            await run.close()
    finally:
        if ask.store and not kept:  # failed, cut or cancelled: nothing to keep
            await store.drop(response_id, client)


async def _stream(
    exchange: Exchange, reply: ResponseObject, run: Run, admitted: Admitted, keep: Callable[[Collected, dict], None]
) -> web.StreamResponse:
    out = web.StreamResponse(
        headers={**exchange.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await out.prepare(exchange.request)
    events = Events(reply)
    collected = Collected(0)
    try:
        await out.write(events.opening())
        async with contextlib.aclosing(run.steps()) as steps:
            async for _, step in steps:
                collected.add(step)
                if data := events.step(step):
                    await out.write(data)
        closing, whole = events.closing(collected, run.usage())
        keep(collected, whole)
        await out.write(closing)
        admitted.end(collected.finish or "cancelled")
    except ConnectionResetError:  # the client went away: its request is aborted as steps closes
        admitted.end("cancelled")
    except Exception as exc:  # the status line is out: the error is an event
        admitted.end("error")
        await out.write(events.error(exchange.fail(exc)))
    return out
