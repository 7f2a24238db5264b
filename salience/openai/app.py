"""The OpenAI API over HTTP, beside LMTP's WebSocket on the same port: the aiohttp adapter.

`GET /v1/models`, `GET /v1/models/{model}`, `POST /v1/completions` and
`POST /v1/chat/completions`. Each handler only converts: the body to an ApiRequest
(requests.py), its choices to engine generations (run.py), their steps to bytes (responses.py),
and any error to OpenAI's error object with its status (errors.py). The Responses API
(`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`) is read, checked and admitted here
alike, then run on the chat path by responses_http.py.

Every request has an id: the `x-request-id` header, else a new one; it is the logging context,
the engine's request id, the response's `id` (`chatcmpl-<id>`, `cmpl-<id>`) and its
`x-request-id` header. A completion is admitted as one stream (ServerStatus.admit): refused
with 503 while the model loads or the server drains, counted in flight until it ends.

A client that goes away must not leave its request running in vLLM. aiohttp tells a handler
only when it next writes (a stream's next chunk), or by cancelling it, which its
`handler_cancellation` would do for every handler of the port, LMTP's WebSocket included. So
the work runs in a task of its own, and the handler looks at the connection every
`POLL_SECONDS` while it waits: when the transport is gone it cancels the work, whose generations
close and abort their requests in vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import orjson
from aiohttp import web

from salience import metrics, request_ids
from salience.auth import Client, Tokens
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import Admitted, ServerStatus
from salience.errors import SalienceError
from salience.logs import CLIENT_NAME, REQUEST_ID
from salience.openai.errors import ApiError, from_salience, naming, unauthorized
from salience.openai.requests import CHAT, ApiRequest, parse_chat, parse_completion
from salience.openai.response_store import ResponseStore
from salience.openai.responses import DONE, Chunks, Collected, Logprobs, response
from salience.openai.responses_api import RESPONSE, parse_responses
from salience.openai.responses_http import Exchange, answer
from salience.openai.run import Run, prompts
from salience.scopes import asked, needs

__all__ = ["FRONTEND", "OPENAI", "OpenAIContext", "add_routes"]

log = logging.getLogger(__name__)

FRONTEND = "openai"  # the metrics' frontend label
POLL_SECONDS = 0.5  # how often a waiting handler looks whether its client is still there
T = TypeVar("T")


@dataclass(frozen=True)
class OpenAIContext:
    status: ServerStatus
    tokens: Tokens
    created: int  # the models' `created`: when the server started
    responses: ResponseStore  # the Responses API's stored responses, on the shared sessions


OPENAI = web.AppKey("openai", OpenAIContext)


def add_routes(
    app: web.Application, status: ServerStatus, tokens: Tokens, sessions: SessionStore | None = None
) -> None:
    """The routes; `sessions` (shared with the other frontends) keep stored responses."""
    stored = ResponseStore(sessions if sessions is not None else SessionStore(status.serving_engine))
    app[OPENAI] = OpenAIContext(status, tokens, int(time.time()), stored)
    app.middlewares.append(_unknown_routes)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)


@web.middleware
async def _unknown_routes(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """A path under /v1/ that no route serves (or not with that method) answers OpenAI's error object,
    as OpenAI's server does (`Invalid URL (POST /v1/foo)`), so a client shows why; the rest of the
    port (LMTP's WebSocket, the page) is left as aiohttp answers it."""
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
        if not request.path.startswith("/v1/") or request.match_info.route.resource is not None:
            raise  # not under /v1/, or a route's own answer
        error = ApiError(exc.status, f"Invalid URL ({request.method} {request.path})", kind="NotFound")
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
        return web.Response(
            status=exc.status, body=orjson.dumps(error.body()), content_type="application/json", headers=headers
        )


# ---- models ---------------------------------------------------------------------------------


def _model_card(context: OpenAIContext, name: str) -> dict:
    return {"id": name, "object": "model", "created": context.created, "owned_by": "salience"}


async def models(request: web.Request) -> web.Response:
    """The names a request may use, the served name first; 503 while loading or draining."""

    async def listed(context: OpenAIContext) -> web.Response:
        status = context.status
        names = [status.model_name, *sorted(status.model_names - {status.model_name})]
        return _json({"object": "list", "data": [_model_card(context, name) for name in names]}, request)

    return await _handle(request, listed)


async def model(request: web.Request) -> web.Response:
    async def card(context: OpenAIContext) -> web.Response:
        name = request.match_info["model"]
        with naming("model", status=404, code="model_not_found"):
            context.status.check_model(name)
        return _json(_model_card(context, name), request)

    return await _handle(request, card)


# ---- completions ------------------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, parse_chat)


async def _complete(request: web.Request, parse: Callable[[bytes], ApiRequest]) -> web.StreamResponse:
    async def complete(context: OpenAIContext) -> web.StreamResponse:
        api = parse(await _body(request))
        client: Client = request[_CLIENT]
        with naming("model", status=404, code="model_not_found"):
            context.status.check_model(api.model)
        with naming():
            client.require(needs(f"POST {request.path}") + _asked(api))
            admitted = context.status.admit(FRONTEND, api.kind, **client.admission())
        with admitted:  # ends it as "error" or "cancelled" if what follows raises
            engine = admitted.engine
            run = await Run.start(engine, api, await prompts(engine, api), request[_ID], client)
            try:
                if api.stream:
                    return await _stream(request, context, api, run, admitted)
                return await _whole(request, context, api, run, admitted)
            finally:
                await run.close()

    return await _handle(request, complete)


async def _whole(
    request: web.Request, context: OpenAIContext, api: ApiRequest, run: Run, admitted: Admitted
) -> web.Response:
    collected = {choice.index: Collected(choice.index) for choice in run.choices}
    async with contextlib.aclosing(run.steps()) as steps:
        async for index, step in steps:
            collected[index].add(step)
    admitted.end(run.choices[0].finish or "cancelled")
    logprobs = Logprobs(api.kind, run.pieces, api.top_logprobs) if api.logprobs else None
    body = response(
        api.kind,
        _response_id(api, request),
        int(time.time()),
        context.status.model_name,
        list(collected.values()),
        run.usage(),
        logprobs,
        run.layout,
    )
    return web.Response(body=body, content_type="application/json", headers=_headers(request))


async def _stream(
    request: web.Request, context: OpenAIContext, api: ApiRequest, run: Run, admitted: Admitted
) -> web.StreamResponse:
    out = web.StreamResponse(
        headers={**_headers(request), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await out.prepare(request)
    logprobs = Logprobs(api.kind, run.pieces, api.top_logprobs) if api.logprobs else None
    chunks = Chunks(api.kind, _response_id(api, request), int(time.time()), context.status.model_name, logprobs)
    chunks.layout = run.layout
    try:
        if api.kind == CHAT:
            for choice in run.choices:
                await out.write(chunks.role(choice.index))
        async with contextlib.aclosing(run.steps()) as steps:
            async for index, step in steps:
                await out.write(chunks.step(index, step))
        if api.include_usage:
            await out.write(chunks.usage(run.usage()))
        admitted.end(run.choices[0].finish or "cancelled")
    except ConnectionResetError:  # the client went away: its requests are aborted as steps closes
        admitted.end("cancelled")
        return out
    except Exception as exc:  # the status line is out: the error is an event, which the client raises
        error = _as_api_error(exc)
        _failed(error, request)
        admitted.end("error")
        await out.write(chunks.error(error))
    await out.write(DONE)
    return out


# ---- the Responses API (responses_http.py) ---------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    async def create(context: OpenAIContext) -> web.StreamResponse:
        ask = parse_responses(await _body(request))
        client: Client = request[_CLIENT]
        with naming("model", status=404, code="model_not_found"):
            context.status.check_model(ask.chat.model)
        with naming():
            client.require(needs("POST /v1/responses") + _asked(ask.chat))
            admitted = context.status.admit(FRONTEND, RESPONSE, **client.admission())
        with admitted:  # ends it as "error" or "cancelled" if what follows raises
            exchange = Exchange(
                request, request[_ID], client, context.status.model_name, _headers(request), _failure(request)
            )
            return await answer(exchange, ask, context.responses, admitted)

    return await _handle(request, create)


async def get_response(request: web.Request) -> web.Response:
    async def get(context: OpenAIContext) -> web.Response:
        with naming():
            request[_CLIENT].require(needs("GET /v1/responses/{id}"))
            return _json(context.responses.find(request.match_info["response_id"], request[_CLIENT]).body, request)

    return await _handle(request, get)


async def delete_response(request: web.Request) -> web.Response:
    async def delete(context: OpenAIContext) -> web.Response:
        response_id = request.match_info["response_id"]
        with naming():
            request[_CLIENT].require(needs("DELETE /v1/responses/{id}"))
            await context.responses.delete(response_id, request[_CLIENT])
        return _json({"id": response_id, "object": "response", "deleted": True}, request)

    return await _handle(request, delete)


# ---- what every handler shares ------------------------------------------------------------------

_ID = web.RequestKey("openai_request_id", str)
_CLIENT = web.RequestKey("openai_client", Client)


def _asked(api: ApiRequest) -> tuple[str, ...]:
    """The scopes the request's `salience` extension asks for."""
    return () if api.salience is None else asked(api.salience.probes())


async def _handle(
    request: web.Request, work: Callable[[OpenAIContext], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The request id, the token, the phase, then `work`, with every error as OpenAI's object."""
    context = request.app[OPENAI]
    given = request.headers.get(request_ids.HEADER)
    request[_ID] = request_ids.new()
    REQUEST_ID.set(request[_ID])
    try:
        if given is not None:
            with naming():
                request[_ID] = request_ids.check(given, "the x-request-id header")
            REQUEST_ID.set(request[_ID])
        request[_CLIENT] = context.tokens.identify(request.headers.get("Authorization"), peer=request.remote)
        if request[_CLIENT] is None:
            metrics.AUTH_FAILURES.labels(FRONTEND).inc()
            raise unauthorized()
        CLIENT_NAME.set(request[_CLIENT].name)
        with naming():
            context.status.serving_engine()  # 503 while loading, draining or stopping
        return await _while_connected(request, work(context))
    except ConnectionResetError:  # the client is gone (_ClientGone, a failed write): nobody reads an answer
        return web.Response(status=499)  # what access logs call it
    except Exception as exc:
        return _error(_as_api_error(exc), request)


def _as_api_error(exc: Exception) -> ApiError:
    """Any error as OpenAI's object: ours as mapped, anything else an internal error, logged."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SalienceError):
        return from_salience(exc)
    log.exception("request failed", exc_info=exc)
    return ApiError(500, "internal server error", type="server_error", kind="InternalError")


class _ClientGone(ConnectionResetError):
    pass


async def _while_connected(request: web.Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client goes away first, `work` is cancelled and _ClientGone raised."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise _ClientGone
    finally:
        if not task.done():  # the handler itself was cancelled (the server is stopping)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.client_max_size
        raise ApiError(413, f"the request body exceeds {limit} bytes (--lmtp-max-message-bytes)") from None


def _response_id(api: ApiRequest, request: web.Request) -> str:
    return ("chatcmpl-" if api.kind == CHAT else "cmpl-") + request[_ID]


def _headers(request: web.Request) -> dict[str, str]:
    return {request_ids.HEADER: request[_ID]}


def _json(payload: dict, request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json", headers=_headers(request))


def _failure(request: web.Request) -> Callable[[Exception], ApiError]:
    """How an error after a stream's status line is reported: as OpenAI's object, logged and counted."""

    def fail(exc: Exception) -> ApiError:
        error = _as_api_error(exc)
        _failed(error, request)
        return error

    return fail


def _failed(error: ApiError, request: web.Request) -> None:
    if error.status != 401:  # auth failures are counted apart
        metrics.ERRORS.labels(FRONTEND, error.kind).inc()
    extra = {"request_id": request[_ID], "status": error.status, "kind": error.kind, "error": error.message}
    log.info("request failed", extra=extra)


def _error(error: ApiError, request: web.Request) -> web.Response:
    _failed(error, request)
    headers = _headers(request)
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if error.retry_after is not None:
        headers["Retry-After"] = str(math.ceil(error.retry_after))  # whole seconds, as HTTP has them
    return web.Response(
        status=error.status, body=orjson.dumps(error.body()), content_type="application/json", headers=headers
    )
