"""OpenAI's Responses objects, sans I/O: a response object, whole, and a stream's events, as bytes.

A response's output is the chat path's one choice (run.py) as items: the assistant's `message`,
with one `output_text` part, when the reply has text (or calls nothing), then one
`function_call` item per tool call. Its `status` is `completed`, or `incomplete` when the reply
was cut by `max_output_tokens` (chat's finish_reason "length") or a monitor (chat's
"content_filter"), with `incomplete_details.reason` saying which.

A stream sends the events the `openai` SDK parses, each numbered (`sequence_number`) and named in
its SSE `event:` line: `response.created`, `response.in_progress`; for the message
`response.output_item.added`, `response.content_part.added`, a `response.output_text.delta` per
token that adds text, and at the end `response.output_text.done`, `response.content_part.done`,
`response.output_item.done`; for a call `response.output_item.added`,
`response.function_call_arguments.delta` as its arguments come, `.done` and
`response.output_item.done`; then `response.completed` (or `response.incomplete`). Items open
as their first piece comes, and their output_index is their order. An error once the stream is
out is an `error` event and then `response.failed`.

The `salience` extension, only when the request had one (its parts as chat's, responses.py): the
response's `salience` holds the readout layout and, once it has ended, what a chat choice's
`salience` holds (`tokens`, `prompt`, `summary`, `fields`, `tool_calls`, `stopped_by`); in a
stream each token's entry rides on an output_text delta (empty where the token adds no text).
"""

from __future__ import annotations

from typing import Any

import orjson

from salience.core.engine.chat_messages import ToolCall
from salience.openai.choices import Step
from salience.openai.errors import ApiError
from salience.openai.responses import Collected, _choice_extension

__all__ = ["Events", "ResponseObject", "reply_of", "usage"]

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}  # chat's finish -> reason


def usage(chat: dict) -> dict:
    """The chat path's usage (responses.usage) as the Responses API counts it."""
    return {
        "input_tokens": chat["prompt_tokens"],
        # cache_write_tokens counts OpenAI's explicit cache writes (prompt_cache_options): none here
        "input_tokens_details": {
            "cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def reply_of(collected: Collected) -> tuple[str | None, tuple[ToolCall, ...]]:
    """An ended choice's text (None: the reply is only calls) and calls."""
    reply = collected.reply
    if reply is None:
        return "".join(collected.text), ()
    return (reply.content if reply.content is not None or reply.calls else ""), reply.calls


class ResponseObject:
    """One response's object: its fixed fields (`echo`: what the request asked, responses_api.py),
    then as it ends, its items and usage."""

    def __init__(self, response_id: str, created: int, model: str, echo: dict[str, Any]) -> None:
        self.id = response_id
        self.message_id = "msg_" + response_id.removeprefix("resp_")
        self.layout: dict | None = None  # the readout layout, once the run has started
        self._head = {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "model": model,
            "output": [],
            "truncation": "disabled",
            "error": None,
            "incomplete_details": None,
            **echo,
        }

    def pending(self) -> dict:
        """The response before its output: in progress."""
        return self._with({"status": "in_progress", "usage": None}, None)

    def items(self, collected: Collected) -> list[dict]:
        """The ended choice's items, in order: its message (if any), then its calls."""
        text, calls = reply_of(collected)
        status = self.status(collected)[0]
        message = [self.message(text, status)] if text is not None else []
        return message + [call_item(call, status) for call in calls]

    def whole(self, collected: Collected, counts: dict, items: list[dict] | None = None) -> dict:
        """The ended response: `collected` its choice, `counts` the chat path's usage, `items` its
        output (by default `items(collected)`)."""
        status, reason = self.status(collected)
        extension = _choice_extension(collected.entries, collected.prompt, collected.end)
        fields = {
            "status": status,
            "incomplete_details": {"reason": reason} if reason else None,
            "output": items if items is not None else self.items(collected),
            "usage": usage(counts),
        }
        return self._with(fields, extension)

    def message(self, text: str | None, status: str) -> dict:
        """The message item: in progress (`text` None) or ended."""
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [] if text is None else [text_part(text)],
        }

    def _with(self, fields: dict, extension: dict | None) -> dict:
        body = {**self._head, **fields}
        if self.layout is not None or extension is not None:
            body["salience"] = {**(self.layout or {}), **(extension or {})}
        return body

    @staticmethod
    def status(collected: Collected) -> tuple[str, str | None]:
        reason = _INCOMPLETE.get(collected.finish or "")
        return ("incomplete" if reason else "completed"), reason


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: ToolCall, status: str) -> dict:
    return {
        "id": "fc_" + call.id.removeprefix("call_"),
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


class Events:
    """One stream's events, numbered in order, and the items it has opened."""

    def __init__(self, reply: ResponseObject) -> None:
        self._reply = reply
        self._number = 0
        self._message: int | None = None  # the message item's output_index, once opened
        self._calls: dict[int, int] = {}  # a call's index in the reply -> its item's output_index
        self._opened: list[dict] = []  # each item as added, by output_index

    def opening(self) -> bytes:
        pending = self._reply.pending()
        return self._event("response.created", response=pending) + self._event("response.in_progress", response=pending)

    def step(self, step: Step) -> bytes:
        """What a token adds: text (and its extension entry) to the message, arguments to calls."""
        out = []
        extension = _choice_extension([step.entry] if step.entry is not None else None, step.prompt, None)
        if step.text or extension is not None:
            out.append(self._open_message())
            fields: dict = {**self._at_message(), "content_index": 0, "delta": step.text, "logprobs": []}
            if extension is not None:
                fields["salience"] = extension
            out.append(self._event("response.output_text.delta", **fields))
        for delta in step.calls or ():
            function = delta.get("function", {})
            if delta["index"] not in self._calls:
                call = ToolCall(id=delta["id"], name=function["name"], arguments="")
                out.append(self._open(call_item(call, "in_progress")))
                self._calls[delta["index"]] = len(self._opened) - 1
            if arguments := function.get("arguments"):
                at = self._calls[delta["index"]]
                item_id = self._opened[at]["id"]
                out.append(
                    self._event(
                        "response.function_call_arguments.delta", item_id=item_id, output_index=at, delta=arguments
                    )
                )
        return b"".join(out)

    def closing(self, collected: Collected, counts: dict) -> tuple[bytes, dict]:
        """The ends of every item and of the response; and the ended response."""
        text, calls = reply_of(collected)
        status = self._reply.status(collected)[0]
        out = []
        if text is not None or not calls:
            out.append(self._open_message())
        for i, call in enumerate(calls):  # calls the stream never showed (a parser's last word)
            if i not in self._calls:
                out.append(self._open(call_item(ToolCall(id=call.id, name=call.name, arguments=""), "in_progress")))
                self._calls[i] = len(self._opened) - 1
        items = []
        for at, opened in enumerate(self._opened):
            if at == self._message:
                item = self._reply.message(text or "", status)
                part = item["content"][0]
                where = {**self._at_message(), "content_index": 0}
                out.append(self._event("response.output_text.done", **where, text=part["text"], logprobs=[]))
                out.append(self._event("response.content_part.done", **where, part=part))
            else:
                index = next(i for i, a in self._calls.items() if a == at)
                call = (
                    calls[index]
                    if index < len(calls)
                    else ToolCall(id=opened["call_id"], name=opened["name"], arguments="")
                )
                item = call_item(call, status)
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=at,
                        arguments=item["arguments"],
                    )
                )
            out.append(self._event("response.output_item.done", output_index=at, item=item))
            items.append(item)
        whole = self._reply.whole(collected, counts, items)
        ended = "completed" if whole["status"] == "completed" else "incomplete"
        out.append(self._event(f"response.{ended}", response=whole))
        return b"".join(out), whole

    def error(self, error: ApiError) -> bytes:
        """An error once the stream is out: the `error` event, then the response failed."""
        failed = {
            **self._reply.pending(),
            "status": "failed",
            "error": {"code": _code(error), "message": error.message},
        }
        return self._event("error", code=error.code, message=error.message, param=error.param) + self._event(
            "response.failed", response=failed
        )

    def _open_message(self) -> bytes:
        if self._message is not None:
            return b""
        added = self._open(self._reply.message(None, "in_progress"))
        self._message = len(self._opened) - 1
        part = self._event("response.content_part.added", **self._at_message(), content_index=0, part=text_part(""))
        return added + part

    def _open(self, item: dict) -> bytes:
        self._opened.append(item)
        return self._event("response.output_item.added", output_index=len(self._opened) - 1, item=item)

    def _at_message(self) -> dict:
        return {"item_id": self._reply.message_id, "output_index": self._message}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._number, **fields}
        self._number += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def _code(error: ApiError) -> str:
    """A failed response's `error.code`, one of OpenAI's."""
    return "rate_limit_exceeded" if error.status == 429 else "server_error"
