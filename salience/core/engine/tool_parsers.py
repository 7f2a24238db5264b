"""Tool calls found in a model's text by vLLM's parser for its family (`vllm/tool_parsers/`).

A model offered tools writes a call in its family's own syntax (Hermes and Qwen2.5:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; Mistral: `[TOOL_CALLS]...`). When the
client lets the model decide (`tool_choice` auto), the reply is parsed for calls by vLLM's parser
of that name (`--tool-call-parser`), or the one the chat template names unambiguously
(`detect`). `CallParser` wraps one request's parser: `parse` reads a whole reply, `feed` a
stream's new text, each giving the content and the calls in OpenAI's form.

vLLM's parsers take a `ChatCompletionRequest`; one is built holding only the tools, which is all
the parsers read of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from salience.errors import InvalidArgument

__all__ = ["CallParser", "Parsed", "check_parser", "detect"]

# What a template writes that names its family's parser with no doubt: the marker, the parser,
# and markers that rule it out (Qwen3-Coder's XML calls share the <tool_call> tag).
_MARKERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (("<tool_call>", "hermes", ("<function=", "<parameter=")),)


def check_parser(name: str) -> str:
    """`name` if vLLM has a tool parser of that name, else InvalidArgument listing them."""
    from vllm.tool_parsers import ToolParserManager

    known = ToolParserManager.list_registered()
    if name not in known:
        raise InvalidArgument(f"--tool-call-parser {name}: vLLM has no such tool parser; it has {', '.join(known)}")
    return name


def detect(template: str | None) -> str | None:
    """The parser a chat template's own call syntax names, when exactly one does."""
    if template is None:
        return None
    found = {name for marker, name, unless in _MARKERS if marker in template and not any(u in template for u in unless)}
    return found.pop() if len(found) == 1 else None


@dataclass(frozen=True)
class Parsed:
    """Content (None: none) and calls, each `{"name", "arguments"}` (arguments as JSON text); in a
    stream's delta, OpenAI's delta tool calls (`{"index", "id"?, "type"?, "function": {...}}`)."""

    content: str | None
    calls: tuple[dict, ...]


class CallParser:
    """One request's parser: `name` (vLLM's), for `tools` in OpenAI's chat form."""

    def __init__(self, name: str, tokenizer: Any, tools: Sequence[Mapping]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self._request = ChatCompletionRequest(model="-", messages=[], tools=list(tools), tool_choice="auto")
        self._parser = ToolParserManager.get_tool_parser(name)(tokenizer, self._request.tools)
        self._text = ""
        self._ids: list[int] = []

    def parse(self, text: str) -> Parsed:
        """A whole reply's content and calls (none when the model wrote no call, or an unfinished one)."""
        found = self._parser.extract_tool_calls(text, self._request)
        if not found.tools_called:
            return Parsed(text, ())
        calls = tuple({"name": c.function.name, "arguments": c.function.arguments} for c in found.tool_calls)
        return Parsed(found.content or None, calls)

    def feed(self, text: str, token_ids: Sequence[int]) -> Parsed:
        """A stream's next text (and the tokens it came from): the content it releases and the tool-call
        deltas; a parser holds back what may begin a call."""
        previous, previous_ids = self._text, list(self._ids)
        self._text += text
        self._ids.extend(token_ids)
        delta = self._parser.extract_tool_calls_streaming(
            previous, self._text, text, previous_ids, list(self._ids), list(token_ids), self._request
        )
        if delta is None:
            return Parsed(None, ())
        calls = tuple(call.model_dump(exclude_none=True) for call in delta.tool_calls)
        return Parsed(delta.content or None, calls)
