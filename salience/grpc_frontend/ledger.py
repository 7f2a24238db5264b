"""Sans-IO: what a client knows of one session (its length, the requests it builds, with the
messages and interventions it is given as protobuf) and what a Generate or a ChatGenerate
returned. client.py drives these over a channel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from salience.core.probes.steering import Intervention, Op
from salience.core.probes.steering_json import parse_interventions
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.v1 import salience_pb2 as pb

__all__ = ["ChatResult", "GenerateResult", "Ledger", "Range", "chat_message_proto", "defaults", "interventions_proto"]

# [start, end) in absolute positions; end None: through the end of the call (what the
# session will hold after the append plus max_tokens), which the client works out, except in a
# chat turn, whose append the server renders: there it asks for the largest end, clipped.
Range = tuple[int, int | None]
_OPEN_END = 2**32 - 1


@dataclass
class GenerateResult:
    prefill: list[pb.Token] = field(default_factory=list)  # covered prompt positions
    tokens: list[pb.Token] = field(default_factory=list)  # decoded
    done: pb.GenerateDone | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def add(self, event: pb.GenerateEvent) -> None:
        if event.HasField("done"):
            self.done = event.done
        else:
            (self.prefill if event.token.is_prefill else self.tokens).append(event.token)


@dataclass
class ChatResult(GenerateResult):
    """A ChatGenerate's result: where the template's tokens went, the turn, and the reply."""

    offset: int = 0  # the session was rewound here (its length before the call, unless re-rendered)
    appended: list[int] = field(default_factory=list)  # then these were appended
    events: list[ext.ExtendedGenerateEvent] = field(default_factory=list)  # the turn's, with monitors and rows
    reply: ext.ChatMessage | None = None

    def add_chat(self, event: ext.ChatGenerateEvent) -> None:
        if event.HasField("appended"):
            self.offset, self.appended = event.appended.offset, list(event.appended.tokens)
            return
        self.events.append(event.event)
        self.add(event.event.event)
        if event.HasField("reply"):
            self.reply = event.reply


def chat_message_proto(message: Mapping[str, Any] | ext.ChatMessage) -> ext.ChatMessage:
    """A message in OpenAI's JSON form (`{"role": ..., "content": "..." or [parts]}`) as protobuf."""
    if isinstance(message, ext.ChatMessage):
        return message
    content = message.get("content", "")
    parts = []
    if not isinstance(content, str):
        parts = [
            ext.ContentPart(text=p["text"])
            if p.get("type") == "text"
            else ext.ContentPart(image_url=p["image_url"]["url"])
            for p in content
        ]
        content = ""
    rest = {key: message[key] for key in ("name", "tool_call_id") if message.get(key) is not None}
    return ext.ChatMessage(role=message.get("role", ""), content=content, parts=parts, **rest)


_OPS = {
    Op.ADD: ext.Intervention.OP_ADD,
    Op.SET: ext.Intervention.OP_SET,
    Op.ABLATE: ext.Intervention.OP_ABLATE,
    Op.CAP: ext.Intervention.OP_CAP,
}


def interventions_proto(steer: Sequence[Intervention | dict]) -> list[ext.Intervention]:
    """`steer` as the extension's messages: Interventions, or their JSON form (as LMTP takes it)."""
    out = []
    for item in steer:
        i = item if isinstance(item, Intervention) else parse_interventions([item])[0]
        out.append(
            ext.Intervention(
                direction=i.direction,
                vector=i.vector or b"",
                layers=i.layers,
                op=_OPS[i.op],
                value=i.value,
                lo=i.lo,
                hi=i.hi,
                prompt=i.prompt,
                ranges=[pb.PositionRange(start=s, end=e) for s, e in i.ranges],
                generated=i.generated,
            )
        )
    return out


class Ledger:
    """Sans-IO: the client's view of one session. Builds requests, learns from events."""

    def __init__(self, session_id: str, length: int) -> None:
        self.session_id = session_id
        self.length = length
        self.synced = True

    def request(
        self,
        append: Sequence[int],
        truncate_to: int | None,
        *,
        max_tokens: int,
        logprobs_ranges: Sequence[Range],
        logprob_top_k: int,
        readout_ranges: Sequence[Range],
        temperature: float,
        top_p: float,
        top_k: int,
        stop_token_ids: Sequence[int],
        priority: int,
        images: Sequence[pb.ImageAttachment],
        chat: bool = False,
    ) -> pb.GenerateRequest:
        """The request for one call; `chat`: a chat turn's, whose append the server renders."""
        offset = self.length if truncate_to is None else truncate_to
        end_of_call = _OPEN_END if chat else offset + len(append) + max_tokens

        def ranges(given: Sequence[Range]) -> list[pb.PositionRange]:
            return [pb.PositionRange(start=s, end=end_of_call if e is None else e) for s, e in given]

        request = pb.GenerateRequest(
            session_id=self.session_id,
            append_tokens=append,
            offset=offset,
            truncating=truncate_to is not None and truncate_to < self.length,
            max_tokens=max_tokens,
            logprobs_ranges=ranges(logprobs_ranges),
            logprob_top_k=logprob_top_k,
            readout_ranges=ranges(readout_ranges),
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=stop_token_ids,
            priority=priority,
            images=images,
        )
        self.synced = False  # until the stream ends cleanly
        self._after_append = offset + len(append)
        return request

    def accepted(self) -> None:
        """The first event arrived: the server validated and applied the append."""
        self.length = self._after_append

    def observe_chat(self, event: ext.ChatGenerateEvent) -> None:
        """A ChatGenerate's event. The first says where the server put the template's tokens: it
        rewound to `offset` (before it only to re-render its own last reply) and appended them."""
        if event.HasField("appended"):
            self.length = self._after_append = event.appended.offset + len(event.appended.tokens)
        else:
            self.observe(event.event.event)

    def observe(self, event: pb.GenerateEvent) -> None:
        if event.HasField("done"):
            self.length = self._after_append + event.done.completion_tokens
            self.synced = True
        elif not event.token.is_prefill:
            self.length += 1


DEFAULTS = {
    "max_tokens": 0,
    "logprobs_ranges": (),
    "logprob_top_k": 0,
    "readout_ranges": (),
    "temperature": 0.0,
    "top_p": 0.0,
    "top_k": 0,
    "stop_token_ids": (),
    "priority": 0,
    "images": (),
}


def defaults(params: dict) -> dict:
    unknown = set(params) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown Generate parameters: {', '.join(sorted(unknown))}")
    return {**DEFAULTS, **params}
