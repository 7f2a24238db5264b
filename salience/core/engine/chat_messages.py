"""Chat messages as OpenAI's chat API writes them, checked for shape before a template sees them.

Every frontend that takes messages reads them here, so a bad one gets the same error, naming the
field (`messages[2].role`), on every wire. Only shape is checked: whether the model can read a
part (an image on a text model) is the renderer's check (chat.py), which knows the model. No
transformers here: the LMTP codec, which the client-only install carries, reads messages with it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from salience.errors import InvalidArgument

__all__ = [
    "ROLES",
    "ChatMessage",
    "ContentPart",
    "ImagePart",
    "TextPart",
    "ToolCall",
    "check_tool_replies",
    "parse_messages",
]

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's
_MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "tool_calls")


@dataclass(frozen=True, kw_only=True)
class TextPart:
    text: str


@dataclass(frozen=True, kw_only=True)
class ImagePart:
    """An image given inline: a data: URL (the server fetches nothing)."""

    url: str


ContentPart = TextPart | ImagePart


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """A function call an assistant message made: `arguments` is the JSON text the model wrote
    (OpenAI's form; not necessarily valid JSON)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    role: str
    content: str | tuple[ContentPart, ...]  # "" for an assistant message that only calls tools
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's answer to the call of that id
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls


def parse_messages(value: Any, name: str = "messages") -> tuple[ChatMessage, ...]:
    """`value` (JSON) as messages, or InvalidArgument naming the first bad field."""
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a list of messages", field=name)
    if not value:
        raise InvalidArgument(f"{name} must hold at least one message", field=name)
    return tuple(_message(item, f"{name}[{i}]") for i, item in enumerate(value))


def check_tool_replies(messages: Sequence[ChatMessage], name: str = "messages") -> None:
    """Each tool message answers a call an earlier assistant message made (its tool_call_id is
    that call's id), as OpenAI's API requires of a whole conversation. Not part of
    `parse_messages`: a session's conversation arrives a message at a time."""
    calls: set[str] = set()
    for i, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role != "tool":
            continue
        if message.tool_call_id is None:
            raise InvalidArgument(
                f"{name}[{i}].tool_call_id is required: a tool message answers a tool call",
                field=f"{name}[{i}].tool_call_id",
            )
        if message.tool_call_id not in calls:
            raise InvalidArgument(
                f"{name}[{i}].tool_call_id {_show(message.tool_call_id)} answers no tool call "
                "of an earlier assistant message",
                field=f"{name}[{i}].tool_call_id",
            )


def _message(value: Any, where: str) -> ChatMessage:
    if not isinstance(value, dict):
        raise InvalidArgument(f'{where} must be an object {{"role": ..., "content": ...}}', field=where)
    unknown = sorted(set(value) - set(_MESSAGE_FIELDS))
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown field {unknown[0]!r}; known: {', '.join(_MESSAGE_FIELDS)}", field=where
        )
    role = value.get("role")
    if role not in ROLES:
        raise InvalidArgument(
            f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}", field=f"{where}.role"
        )
    calls = _tool_calls(value.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
    if role != "assistant" and value.get("tool_calls") is not None:
        raise InvalidArgument(
            f"{where}.tool_calls is only allowed on an assistant message", field=f"{where}.tool_calls"
        )
    content = value.get("content")
    return ChatMessage(
        role=role,
        # OpenAI's assistant message may leave content out (null) when it calls tools
        content="" if content is None and role == "assistant" else _content(content, f"{where}.content"),
        name=_optional_str(value.get("name"), f"{where}.name"),
        tool_call_id=_optional_str(value.get("tool_call_id"), f"{where}.tool_call_id"),
        tool_calls=calls,
    )


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    """OpenAI's `[{"id", "type": "function", "function": {"name", "arguments"}}, ...]`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} must be a list of tool calls", field=where)
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or set(call) - {"id", "type", "function"}
            or call.get("type", "function") != "function"
            or set(function) - {"name", "arguments"}
        ):
            raise InvalidArgument(
                f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', field=at
            )
        for key, text in (("id", call.get("id")), ("function.name", function.get("name"))):
            if not isinstance(text, str) or not text:
                raise InvalidArgument(f"{at}.{key} must be a non-empty string", field=f"{at}.{key}")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise InvalidArgument(
                f"{at}.function.arguments must be a string (the arguments' JSON text)", field=f"{at}.function.arguments"
            )
        calls.append(ToolCall(id=call["id"], name=function["name"], arguments=arguments))
    return tuple(calls)


def _content(value: Any, where: str) -> str | tuple[ContentPart, ...]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"{where} must be a string or a non-empty list of parts", field=where)
    return tuple(_part(part, f"{where}[{i}]") for i, part in enumerate(value))


def _part(value: Any, where: str) -> ContentPart:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        if set(value) != {"type", "text"} or not isinstance(value["text"], str):
            raise InvalidArgument(f'{where} must be {{"type": "text", "text": "..."}}', field=where)
        return TextPart(text=value["text"])
    if kind == "image_url":
        image = value.get("image_url")
        if set(value) != {"type", "image_url"} or not isinstance(image, dict) or not isinstance(image.get("url"), str):
            raise InvalidArgument(
                f'{where} must be {{"type": "image_url", "image_url": {{"url": "data:..."}}}}', field=where
            )
        url = image["url"]
        if url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"{where}.image_url.url is an http(s) URL, and the server fetches nothing: "
                "send the image inline, as a data: URL",
                field=f"{where}.image_url.url",
            )
        if not url.startswith("data:"):
            raise InvalidArgument(f"{where}.image_url.url must be a data: URL", field=f"{where}.image_url.url")
        return ImagePart(url=url)
    raise InvalidArgument(f"{where} must be a text part or an image_url part, got type {_show(kind)}", field=where)


def _optional_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string", field=where)
    return value


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."
