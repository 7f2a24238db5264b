"""A session's chat: its conversation kept beside its tokens, and how new messages join both.

Theory of operation. A chat turn renders the session's conversation plus the new messages with
the model's chat template and the generation prompt. The session's tokens must be a prefix of
that rendering; only what follows is appended, and the assistant's reply is decoded after it.
The template alone decides the tokens, so after every append the session's tokens are exactly
what transformers' `apply_chat_template` gives for the conversation.

Two things break the prefix:
- The assistant's last reply. The session holds the tokens the model sampled, up to the stop
  token that ended them; the template writes the reply's text, which it may tokenize otherwise
  (a sampler can pick a split the tokenizer would not), trim, strip of its reasoning, or end with
  its own end-of-turn token. When the two part inside the last reply, and nothing was added to
  the session since, the session is rewound to the first token that differs and the rendering
  appended from there: the server re-renders its own reply, and `ChatAppend.offset` says where.
- Anything before that reply: a template that renders an earlier turn differently once another
  is added, or tokens appended outside the chat. That is refused, naming the position: the
  history was computed and reported at its positions, and a session is worth keeping only while
  it grows. The client opens a new session and sends it the whole conversation.

Marks record where each chat turn ended, so a fork or a rewind keeps the conversation of exactly
the turns whose tokens it keeps.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from salience.core.engine.chat import ChatRenderer
from salience.core.engine.chat_messages import ChatMessage, ImagePart
from salience.core.engine.requests import FinishReason
from salience.core.serving.turns import Turn, TurnRun
from salience.errors import FailedPrecondition, InvalidArgument

__all__ = ["ChatAppend", "ChatTurn", "Conversation", "Mark", "chat_turn", "check", "plan", "reply"]


@dataclass(frozen=True)
class Mark:
    """Where a chat turn ended: its reply was the conversation's messages[messages - 1]."""

    messages: int
    reply: int  # the reply's first position
    end: int  # the session's length when the turn ended


@dataclass(frozen=True)
class Conversation:
    """Messages past the last mark belong to the turn that is running."""

    messages: tuple[ChatMessage, ...] = ()
    marks: tuple[Mark, ...] = ()

    def cut(self, position: int) -> Conversation:
        """The conversation of a session that keeps only tokens [0, position)."""
        marks = tuple(m for m in self.marks if m.end <= position)
        return Conversation(self.messages[: marks[-1].messages] if marks else (), marks)

    def replied(self, message: ChatMessage, start: int, end: int) -> Conversation:
        """With the running turn's reply, which ran over positions [start, end)."""
        messages = (*self.messages, message)
        return Conversation(messages, (*self.marks, Mark(len(messages), start, end)))


@dataclass(frozen=True)
class ChatAppend:
    """What a chat turn does to the session: rewind to `offset`, append `tokens`; `conversation`
    is the session's with the new messages and without the marks the rewind passed."""

    offset: int
    tokens: tuple[int, ...]
    conversation: Conversation


@dataclass(eq=False)
class ChatTurn:
    """A started chat turn: where its tokens went, the turn to iterate, and once it has ended the
    reply as the conversation keeps it."""

    appended: ChatAppend
    run: TurnRun
    reply: ChatMessage | None = None


def plan(
    renderer: ChatRenderer, tokenizer: Any, conversation: Conversation, tokens: array, new: Sequence[ChatMessage]
) -> ChatAppend:
    """Where `new` goes in a session holding `tokens` and `conversation`, or why it cannot."""
    messages = (*conversation.messages, *new)
    rendering = renderer.render(messages)
    same = _common_prefix(tokens, rendering)
    if same == len(tokens):
        return ChatAppend(same, rendering[same:], Conversation(messages, conversation.marks))
    last = conversation.marks[-1] if conversation.marks else None
    if last is None or last.end != len(tokens) or same < last.reply:
        raise FailedPrecondition(_rewritten(tokenizer, conversation, tokens, rendering, same))
    # The last reply is re-rendered: its turn now ends where the template ends it, if the rendering
    # goes on from there (a fork or rewind to that point keeps the turn).
    marks = conversation.marks[:-1]
    through = renderer.render(messages[: last.messages], add_generation_prompt=False)
    if rendering[: len(through)] == through:
        marks += (Mark(last.messages, last.reply, len(through)),)
    return ChatAppend(same, rendering[same:], Conversation(messages, marks))


def check(messages: Sequence[ChatMessage], turn: Turn, vision: bool) -> None:
    """What a chat turn refuses before it looks at the session. Images would need placing in the
    session's vision blocks: not yet. They are refused here rather than by the renderer, which
    numbers the whole conversation's messages, not the request's."""
    if turn.append or turn.images or turn.truncating:
        raise InvalidArgument(
            "a chat turn appends its messages' rendering: it takes no append_tokens, images or truncating"
        )
    for i, message in enumerate(messages):
        for j, part in enumerate(() if isinstance(message.content, str) else message.content):
            if isinstance(part, ImagePart):
                why = (
                    "a session's chat takes no images yet: append the vision block with Generate"
                    if vision
                    else "this model reads only text"
                )
                raise InvalidArgument(
                    f"messages[{i}].content[{j}] is an image, and {why}", field=f"messages[{i}].content[{j}]"
                )


def chat_turn(turn: Turn, append: ChatAppend) -> Turn:
    """The session turn that applies `append` and runs `turn`'s reply. Range ends are clipped at
    the end of the call: the client cannot know how many tokens the template adds."""
    end = append.offset + len(append.tokens) + turn.sampling.max_tokens

    return dataclasses.replace(
        turn,
        offset=append.offset,
        truncating=True,
        append=append.tokens,
        logprob_ranges=tuple((start, min(stop, end)) for start, stop in turn.logprob_ranges),
        probes=turn.probes.clipped(end),
    )


def reply(tokenizer: Any, tokens: Sequence[int], finish: FinishReason | None) -> ChatMessage:
    """The assistant's message: the decoded tokens' text, without the stop token that ended them
    (the template writes its own end of turn)."""
    if finish is FinishReason.STOP:
        tokens = tokens[:-1]
    text = tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return ChatMessage(role="assistant", content=text)


def _common_prefix(tokens: array, rendering: Sequence[int]) -> int:
    n = min(len(tokens), len(rendering))
    if tokens[:n] == array(tokens.typecode, rendering[:n]):  # C speed: sessions run to 100K+ tokens
        return n
    return next(i for i in range(n) if tokens[i] != rendering[i])


def _rewritten(
    tokenizer: Any, conversation: Conversation, tokens: array, rendering: Sequence[int], position: int
) -> str:
    def show(ids: Sequence[int]) -> str:
        return repr(tokenizer.decode(list(ids), skip_special_tokens=False)) if ids else "nothing"

    marks = conversation.marks
    end = marks[-1].end if marks else 0  # where the last chat turn left the session
    if position >= end or position >= marks[-1].reply:
        where = "in the last reply" if position < end else "after the last reply" if marks else "with no chat turn yet"
        why = (
            f"tokens were appended outside the chat from position {end} on (a reply is re-rendered only while "
            f"it ends the session): rewind to {end} with Generate (truncating), or open a new session"
        )
    else:
        turn = next(i for i, m in enumerate(marks) if position < m.end)
        first = marks[turn - 1].messages if turn else 0
        where = f"in the turn of messages[{first}] to messages[{marks[turn].messages - 1}]"
        why = (
            "the template changes an earlier turn when one is added, so this session cannot grow by it: "
            "open a new session and send it the whole conversation"
        )
    return (
        f"the chat template renders the conversation differently from the session's tokens at position {position}, "
        f"{where}: the session holds {show(tokens[position : position + 1])}, the rendering "
        f"{show(rendering[position : position + 1])}; {why}"
    )
