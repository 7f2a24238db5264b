"""OpenAI responses, sans I/O: chunks as server-sent events, and whole responses, as bytes.

Plain dicts serialized by orjson, not pydantic models: a stream sends one chunk per token, and
the part of a chunk that never changes (`id`, `object`, `created`, `model`) is encoded once per
response. The shapes are OpenAI's (`ChatCompletion`, `ChatCompletionChunk`, `Completion`), which
the tests check by parsing them with the official `openai` package's models.

The `salience` extension adds, only when the request had one:
- top-level `salience` (the whole response, or the stream's first chunk): the readout layout,
  `{"concepts", "layers", "format"}`, when readouts were asked for;
- per choice `salience`: `tokens` (one entry per completion token, in the order of logprobs'
  content; in a stream, the chunk's own), `prompt` (covered prompt positions; in a stream, on
  the choice's first token), and on its last, `summary`, `fields` (a JSON reply's leaves),
  `tool_calls` (each call's arguments' leaves) and `stopped_by` (readings.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from salience.core.engine.requests import TokenEvent
from salience.openai.choices import Step
from salience.openai.errors import ApiError
from salience.openai.requests import CHAT
from salience.openai.tokens import TokenText
from salience.openai.tool_calls import Reply, as_openai

__all__ = ["DONE", "Chunks", "Collected", "response", "sse", "usage"]

DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event holding `payload`."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Logprobs:
    """Tokens as each endpoint's logprobs show them: chat's `content` entries, or the completions
    endpoint's four parallel lists (`text_offset` counts characters of the tokens' texts from
    the completion's start)."""

    def __init__(self, kind: str, pieces: TokenText, top: int) -> None:
        self.chat = kind == CHAT
        self._pieces = pieces
        self._top = top

    def chat_entry(self, event: TokenEvent) -> dict:
        text, raw = self._pieces.text, self._pieces.bytes
        token = event.token_id
        return {
            "token": text(token),
            "logprob": event.logprob,
            "bytes": list(raw(token)),
            "top_logprobs": [
                {"token": text(t), "logprob": lp, "bytes": list(raw(t))} for t, lp in self._alternatives(event)
            ],
        }

    def completion_lists(self, events: Sequence[TokenEvent], offset: int) -> tuple[dict, int]:
        """The lists for `events`, their first at `offset`; and the offset after them."""
        lists: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        text = self._pieces.text
        for event in events:
            token = text(event.token_id)
            lists["tokens"].append(token)
            lists["token_logprobs"].append(event.logprob)
            lists["top_logprobs"].append({text(t): lp for t, lp in self._alternatives(event)})
            lists["text_offset"].append(offset)
            offset += len(token)
        return lists, offset

    def _alternatives(self, event: TokenEvent) -> list[tuple[int, float]]:
        # Alternatives truncation removed (-inf) could not be sampled and have no JSON form.
        return [(t, lp) for t, lp in event.top_logprobs[: self._top] if math.isfinite(lp)]


class Chunks:
    """One stream's events. `logprobs` None: the request asked for none."""

    def __init__(self, kind: str, response_id: str, created: int, model: str, logprobs: Logprobs | None) -> None:
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if kind == CHAT else "text_completion",
            "created": created,
            "model": model,
        }
        self._prefix = b"data: " + orjson.dumps(self._head)[:-1] + b',"choices":['
        self._logprobs = logprobs
        self._chat = kind == CHAT
        self._offsets: dict[int, int] = {}  # completions' text_offset, per choice
        self.layout: dict | None = None  # the readout layout, sent on the first chunk
        self._sent = False

    def role(self, index: int) -> bytes:
        """Chat's first chunk of a choice, which names the role."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def step(self, index: int, step: Step) -> bytes:
        """A token (or a choice's end) of choice `index`."""
        event, finish = step.event, step.finish
        choice: dict = {"index": index}
        if self._chat:
            delta = {"content": step.text} if step.text or (finish is None and step.calls is None) else {}
            if step.calls is not None:
                delta["tool_calls"] = step.calls
            choice["delta"] = delta
        else:
            choice["text"] = step.text
        lists = None
        if self._logprobs is not None and event is not None:
            if self._chat:
                lists = {"content": [self._logprobs.chat_entry(event)]}
            else:
                lists, self._offsets[index] = self._logprobs.completion_lists([event], self._offsets.get(index, 0))
        choice["logprobs"] = lists
        choice["finish_reason"] = finish
        if step.entry is not None or step.prompt or step.end:  # only with the extension
            choice["salience"] = _choice_extension(
                [step.entry] if step.entry is not None else None, step.prompt, step.end
            )
        return self._chunk(choice)

    def usage(self, counts: dict) -> bytes:
        """The last chunk of a stream with include_usage: no choices, the request's usage."""
        return self._whole({**self._head, "choices": [], "usage": counts})

    def error(self, error: ApiError) -> bytes:
        """An error mid-stream: the `openai` client raises it as APIError."""
        return sse(error.body())

    def _chunk(self, choice: dict) -> bytes:
        if not self._sent and self.layout is not None:
            return self._whole({**self._head, "choices": [choice]})
        self._sent = True
        return self._prefix + orjson.dumps(choice) + b"]}\n\n"

    def _whole(self, payload: dict) -> bytes:
        if not self._sent and self.layout is not None:
            payload["salience"] = self.layout
        self._sent = True
        return sse(payload)


def _choice_extension(tokens: list[dict] | None, prompt: list[dict] | None, end: dict | None) -> dict | None:
    extension: dict = {}
    if prompt:
        extension["prompt"] = prompt
    if tokens is not None:
        extension["tokens"] = tokens
    if end:
        extension.update(end)
    return extension or None


@dataclass
class Collected:
    """A choice gathered for a whole (non-streamed) response."""

    index: int
    text: list[str] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    entries: list[dict] | None = None  # the extension's per-token entries, if it asked for them
    prompt: list[dict] | None = None
    finish: str | None = None
    end: dict | None = None
    reply: Reply | None = None  # the content and calls of a reply that may call tools

    def add(self, step: Step) -> None:
        self.text.append(step.text)
        if step.event is not None:
            self.events.append(step.event)
        if step.prompt is not None:
            self.prompt = step.prompt
        if step.entry is not None:
            if self.entries is None:
                self.entries = []
            self.entries.append(step.entry)
        if step.finish is not None:
            self.finish, self.end, self.reply = step.finish, step.end, step.reply


def response(
    kind: str,
    response_id: str,
    created: int,
    model: str,
    choices: Sequence[Collected],
    counts: dict,
    logprobs: Logprobs | None,
    layout: dict | None,
) -> bytes:
    """A whole response, as JSON."""
    out = []
    for collected in sorted(choices, key=lambda c: c.index):
        text = "".join(collected.text)
        choice: dict = {"index": collected.index}
        lists = None
        if kind == CHAT:
            choice["message"] = {"role": "assistant", "content": text}
            if (reply := collected.reply) is not None:
                choice["message"]["content"] = reply.content
                if reply.calls:
                    choice["message"]["tool_calls"] = as_openai(reply.calls)
            if logprobs is not None:
                lists = {"content": [logprobs.chat_entry(event) for event in collected.events]}
        else:
            choice["text"] = text
            if logprobs is not None:
                lists = logprobs.completion_lists(collected.events, 0)[0]
        choice["logprobs"] = lists
        choice["finish_reason"] = collected.finish
        extension = _choice_extension(collected.entries, collected.prompt, collected.end)
        if extension is not None:
            choice["salience"] = extension
        out.append(choice)
    body = {
        "id": response_id,
        "object": "chat.completion" if kind == CHAT else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": counts,
    }
    if layout is not None:
        body["salience"] = layout
    return orjson.dumps(body)
