"""The tool calls in one choice's reply, sans I/O: its text in, OpenAI's `tool_calls` out.

Theory of operation. How a reply holds its calls depends on the request's `tool_choice`
(tools.py): a named function's reply is the call's arguments (constrained to its schema); a
`required` reply is an array `[{"name", "parameters"}, ...]` (constrained too); an `auto` reply is
the model's own text, parsed by vLLM's parser for its family (core/engine/tool_parsers.py).

`Calls.reply` reads a whole reply: its content, its calls, and where each call's arguments lie
in the text (`Reply.spans`, for readouts per argument). In a stream, `Calls.feed` turns each piece
of text into what the chunk carries: content, and OpenAI's delta tool calls (the first delta of a
call holds its `index`, `id`, `type` and `name`; later ones append to its `arguments`). A named
function streams its arguments as they come; an `auto` reply as its parser releases them; a
`required` array is sent call by call once it is whole, since its calls' names and arguments
come in one JSON document. The ids streamed are the reply's ids.

The Responses API calls the same: `Calls(...)` per choice, `reply(text)` at its end.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from salience.core.engine.chat_messages import ToolCall
from salience.core.engine.tool_parsers import CallParser
from salience.openai.errors import bad_request
from salience.openai.tools import Tool, ToolChoice

__all__ = ["Calls", "Reply", "as_openai", "new_call_id", "require_parser"]


def new_call_id() -> str:
    """A call's id, in OpenAI's form."""
    return "call_" + secrets.token_hex(12)


def as_openai(calls: Sequence[ToolCall]) -> list[dict]:
    """Calls as a chat message's `tool_calls`."""
    return [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call in calls
    ]


def require_parser(choice: ToolChoice, parser: str | None, name: str = "tool_choice") -> None:
    """`auto` with tools needs a parser for the model's calls."""
    if choice.mode == "auto" and parser is None:
        raise bad_request(
            f'{name} "auto" needs a parser for this model\'s tool calls, and its chat template names none: '
            'start the server with --tool-call-parser NAME, or send tool_choice "required" or a function',
            name,
        )


@dataclass(frozen=True)
class Reply:
    """A reply's content (None: none) and calls; `spans[i]`: the characters `[start, end)` of call i's
    arguments in the reply's text (None where they are not in it verbatim)."""

    content: str | None
    calls: tuple[ToolCall, ...]
    spans: tuple[tuple[int, int] | None, ...]


class Calls:
    """One choice's calls. `parser`: vLLM's parser name, for `auto`; `tokenizer` with it."""

    def __init__(
        self,
        tools: Sequence[Tool],
        choice: ToolChoice,
        *,
        parser: str | None = None,
        tokenizer: Any = None,
        streaming: bool = False,
    ) -> None:
        if choice.mode == "none" or not tools:
            raise ValueError("Calls reads a reply that may call tools")
        self._choice = choice
        self._text: list[str] = []
        self._ids: list[str] = []  # the ids streamed, by call index
        self._sent = ""  # the content streamed
        self._held = ""  # a named call's whitespace not streamed yet (_released)
        self._begun = False  # whether a named call's arguments have begun
        self._stream: CallParser | None = None
        self._parser: CallParser | None = None
        if choice.mode == "auto":
            assert parser is not None, "require_parser refused auto without one"
            json_tools = [tool.as_json() for tool in tools]
            self._parser = CallParser(parser, tokenizer, json_tools)
            if streaming:  # a parser of its own: streaming keeps state
                self._stream = CallParser(parser, tokenizer, json_tools)

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str, list[dict]]:
        """A stream's next text: the content it releases, and the delta tool calls."""
        self._text.append(text)
        if self._choice.mode == "function":
            arguments = self._released(text)
            if not self._ids:
                self._ids.append(new_call_id())
                head = {"index": 0, "id": self._ids[0], "type": "function"}
                return "", [{**head, "function": {"name": self._choice.name, "arguments": arguments}}]
            return "", [{"index": 0, "function": {"arguments": arguments}}] if arguments else []
        if self._stream is None:  # required: the array is sent once whole (`end`)
            return "", []
        parsed = self._stream.feed(text, token_ids)
        for delta in parsed.calls:
            if "id" in delta and delta["index"] == len(self._ids):
                self._ids.append(delta["id"])
        self._sent += parsed.content or ""
        return parsed.content or "", list(parsed.calls)

    def _released(self, text: str) -> str:
        """What a named call's streamed arguments may say of `text`: the whole reply's arguments are
        its text stripped, so whitespace before them is never sent and whitespace after waits until
        more text follows it (a reply cut short ends in whitespace); the deltas then join to them."""
        pending = self._held + text
        if not self._begun:
            pending = pending.lstrip()
        body = pending.rstrip()
        self._held = pending[len(body) :]
        self._begun = self._begun or bool(body)
        return body

    def end(self) -> tuple[Reply, str, list[dict]]:
        """The reply, once the stream's text is all in, and what a stream has not sent of it: a
        `required` array's calls, or its text when it holds none (cut short); the end of an `auto`
        reply's content that its parser held back (`<tool` may begin a call)."""
        reply = self.reply("".join(self._text))
        if self._stream is not None:
            content = reply.content or ""
            return reply, content[len(self._sent) :] if content.startswith(self._sent) else "", []
        if self._choice.mode != "required":
            return reply, "", []
        if not reply.calls:
            return reply, reply.content or "", []
        return reply, "", [{"index": i, **call} for i, call in enumerate(as_openai(reply.calls))]

    def reply(self, text: str) -> Reply:
        """A whole reply's content, calls and their arguments' places."""
        mode = self._choice.mode
        if mode == "function":
            start = len(text) - len(text.lstrip())
            call = ToolCall(id=self._id(0), name=self._choice.name or "", arguments=text.strip())
            return Reply(None, (call,), ((start, start + len(call.arguments)),))
        if mode == "required":
            try:
                found = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # cut short (max_tokens, a monitor's stop)
                return Reply(text, (), ())
            content = None
        else:
            assert self._parser is not None
            parsed = self._parser.parse(text)
            found = [(c["name"], c["arguments"]) for c in parsed.calls]
            content = parsed.content
        calls = tuple(
            ToolCall(id=self._id(i), name=name, arguments=arguments) for i, (name, arguments) in enumerate(found)
        )
        return Reply(content, calls, _locate(text, [_loads(arguments) for _, arguments in found]))

    def _id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append(new_call_id())
        return self._ids[index]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _locate(text: str, values: Sequence[Any]) -> tuple[tuple[int, int] | None, ...]:
    """Where each of `values` (in order) is written in `text` as a JSON object: the first object
    after the previous one's that decodes to it."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    for value in values:
        found = None
        start = text.find("{", at)
        while start >= 0:
            try:
                decoded, end = decoder.raw_decode(text, start)
            except ValueError:
                decoded, end = None, start + 1
            if decoded == value and isinstance(decoded, dict):
                found = (start, end)
                break
            start = text.find("{", start + 1)
        spans.append(found)
        if found is not None:
            at = found[1]
    return tuple(spans)
