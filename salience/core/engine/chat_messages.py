"""Chat messages as OpenAI's chat API writes them, checked for shape before a template sees them.

Every frontend that takes messages reads them here, so a bad one gets the same error, naming the
field (`messages[2].role`), on every wire. Only shape is checked: whether the model can read a
part (an image on a text model) is the renderer's check (chat.py), which knows the model. No
transformers here: the LMTP codec, which the client-only install carries, reads messages with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from salience.errors import InvalidArgument

__all__ = ["ROLES", "ChatMessage", "ContentPart", "ImagePart", "TextPart", "parse_messages"]

ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's
_MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")


@dataclass(frozen=True, kw_only=True)
class TextPart:
    text: str


@dataclass(frozen=True, kw_only=True)
class ImagePart:
    """An image given inline: a data: URL (the server fetches nothing)."""

    url: str


ContentPart = TextPart | ImagePart


@dataclass(frozen=True, kw_only=True)
class ChatMessage:
    role: str
    content: str | tuple[ContentPart, ...]
    name: str | None = None
    tool_call_id: str | None = None  # a tool message's answer to the call of that id


def parse_messages(value: Any, name: str = "messages") -> tuple[ChatMessage, ...]:
    """`value` (JSON) as messages, or InvalidArgument naming the first bad field."""
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a list of messages")
    if not value:
        raise InvalidArgument(f"{name} must hold at least one message")
    return tuple(_message(item, f"{name}[{i}]") for i, item in enumerate(value))


def _message(value: Any, where: str) -> ChatMessage:
    if not isinstance(value, dict):
        raise InvalidArgument(f'{where} must be an object {{"role": ..., "content": ...}}')
    unknown = sorted(set(value) - set(_MESSAGE_FIELDS))
    if unknown:
        raise InvalidArgument(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(_MESSAGE_FIELDS)}")
    role = value.get("role")
    if role not in ROLES:
        raise InvalidArgument(f"{where}.role must be one of {', '.join(ROLES)}, got {_show(role)}")
    return ChatMessage(
        role=role,
        content=_content(value.get("content"), f"{where}.content"),
        name=_optional_str(value.get("name"), f"{where}.name"),
        tool_call_id=_optional_str(value.get("tool_call_id"), f"{where}.tool_call_id"),
    )


def _content(value: Any, where: str) -> str | tuple[ContentPart, ...]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"{where} must be a string or a non-empty list of parts")
    return tuple(_part(part, f"{where}[{i}]") for i, part in enumerate(value))


def _part(value: Any, where: str) -> ContentPart:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        if set(value) != {"type", "text"} or not isinstance(value["text"], str):
            raise InvalidArgument(f'{where} must be {{"type": "text", "text": "..."}}')
        return TextPart(text=value["text"])
    if kind == "image_url":
        image = value.get("image_url")
        if set(value) != {"type", "image_url"} or not isinstance(image, dict) or not isinstance(image.get("url"), str):
            raise InvalidArgument(f'{where} must be {{"type": "image_url", "image_url": {{"url": "data:..."}}}}')
        url = image["url"]
        if url.startswith(("http://", "https://")):
            raise InvalidArgument(
                f"{where}.image_url.url is an http(s) URL, and the server fetches nothing: "
                "send the image inline, as a data: URL"
            )
        if not url.startswith("data:"):
            raise InvalidArgument(f"{where}.image_url.url must be a data: URL")
        return ImagePart(url=url)
    raise InvalidArgument(f"{where} must be a text part or an image_url part, got type {_show(kind)}")


def _optional_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string")
    return value


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."
