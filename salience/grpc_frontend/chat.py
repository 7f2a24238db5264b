"""Chat in sessions over gRPC: ChatMessage protobufs to the core's messages and back, and a chat
turn run and counted as a Generate is (service.run_turn)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from salience.core.engine.chat_messages import ChatMessage, ImagePart, parse_messages
from salience.core.serving.conversations import ChatTurn
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.core.serving.turns import SessionToken, Turn, TurnDone
from salience.errors import InvalidArgument
from salience.grpc_frontend.service import admit_turn, counted
from salience.proto.salience.ext.v1 import extensions_pb2 as ext

__all__ = ["chat_message", "chat_messages", "run_chat"]


def chat_messages(messages: Sequence[ext.ChatMessage]) -> tuple[ChatMessage, ...]:
    """The request's messages, checked by the parser LMTP and the OpenAI API use on their JSON
    form, so that every wire names a bad field alike (`messages[2].role must be one of ...`)."""
    return parse_messages([_as_json(m, f"messages[{i}]") for i, m in enumerate(messages)])


def chat_message(message: ChatMessage) -> ext.ChatMessage:
    """A message the conversation keeps (the assistant's reply) as protobuf."""
    out = ext.ChatMessage(role=message.role, name=message.name or "", tool_call_id=message.tool_call_id or "")
    if isinstance(message.content, str):
        out.content = message.content
    else:
        out.parts.extend(
            ext.ContentPart(image_url=p.url) if isinstance(p, ImagePart) else ext.ContentPart(text=p.text)
            for p in message.content
        )
    return out


async def run_chat(
    status: ServerStatus, sessions: SessionStore, session_id: str, messages: Sequence[ChatMessage], turn: Turn
) -> AsyncIterator[ChatTurn | SessionToken | TurnDone]:
    """A chat turn, counted: the ChatTurn (where its tokens went; its reply once Done is out), the
    turn's tokens, then how it ended."""
    with admit_turn(status, turn) as admitted:
        chat = await sessions.chat(session_id, messages, turn, admitted.engine)
        announced = False
        async with contextlib.aclosing(counted(admitted, chat.run)) as items:
            # The ChatTurn goes out once the run has begun: a call closed at that event still ends
            # the run, where an unstarted one would keep the session busy.
            async for item in items:
                if not announced:
                    announced = True
                    yield chat
                yield item


def _as_json(message: ext.ChatMessage, where: str) -> dict[str, Any]:
    """OpenAI's JSON form of a message: `parts` become the content list, so errors name a part
    `messages[i].content[j]`, as on every other wire."""
    if message.content and message.parts:
        raise InvalidArgument(f"{where}: content and parts are exclusive (parts are the content, in pieces)")
    content: str | list[dict[str, Any]] = message.content
    if message.parts:
        content = [_part(p, f"{where}.content[{i}]") for i, p in enumerate(message.parts)]
    out: dict[str, Any] = {"role": message.role, "content": content}
    out.update({key: value for key in ("name", "tool_call_id") if (value := getattr(message, key))})
    return out


def _part(part: ext.ContentPart, where: str) -> dict[str, Any]:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image_url":
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    raise InvalidArgument(f"{where} is empty: set text or image_url")
