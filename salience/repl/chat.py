"""The REPL's chat mode: the conversation it keeps, and what each reply adds to it.

On a model with a chat template (MODEL_INFO's `chat_template`), each line is the user's turn: the
REPL sends the whole conversation as GENERATE `messages` and the server renders it with the
template (docs/lmtp.md#chat-messages), so the REPL still needs no tokenizer. The reply ends at the
model's end-of-turn token (finish_reason "stop"), whose text (`<|im_end|>`) is not part of what the
assistant said and is neither printed nor kept. `/raw` goes back to plain completion, where a line
is a prompt the model continues.

Nothing here talks to the server: console.py owns the connection, and these rules (what a turn keeps,
what `/history` prints) are tested without one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["CHAT_COMMANDS", "ChatMode", "Conversation", "Reply", "Turn", "is_end_of_turn"]

# A reply is an answer, not a continuation: 64 tokens would cut most of them short.
RAW_MAX_TOKENS = 64
CHAT_MAX_TOKENS = 256
CHAT_COMMANDS = ("/chat", "/raw", "/system", "/reset", "/history")
NO_TEMPLATE = (
    "the model has no chat template, so each line stays a plain prompt "
    "(start the server with --chat-template FILE to chat)"
)


@dataclass
class Turn:
    """One exchange: what the user typed (without its key=value parameters) and what was said back."""

    user: str
    assistant: str


@dataclass
class Conversation:
    """What chat mode sends with each line: the system message (optional; `/reset` keeps it), then
    the user's and the assistant's turns, alternating, as the templates expect them."""

    system: str | None = None
    turns: list[Turn] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        """The request's `messages`: the conversation so far and the new user turn. The system
        message goes first every time, so changing it changes it for the whole conversation."""
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        for turn in self.turns:
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant}]
        return [*messages, {"role": "user", "content": user}]

    def history(self) -> list[str]:
        """One entry per message, `role: content`, a multi-line content's later lines indented."""
        messages = self.messages("")[:-1]
        if not messages:
            return ["(no conversation yet)"]
        return [_entry(m["role"], m["content"]) for m in messages]


def _entry(role: str, content: str) -> str:
    indent = "\n" + " " * (len(role) + 2)
    return f"{role}: {indent.join(content.splitlines()) if content else ''}"


def is_end_of_turn(payload: dict) -> bool:
    """The token that ended the stream at EOS (or a stop token): it closes the turn, and its text
    is the template's marker, not the assistant's words."""
    return payload.get("finish_reason") == "stop" and "token" in payload


@dataclass(frozen=True)
class Reply:
    """A chat GENERATE's outcome. `start`: the position where the reply begins (the length of the
    rendered prompt, the stream's first payload); `tokens`: the reply's token payloads, without the
    end-of-turn token; `text`: what the assistant said."""

    start: int
    tokens: list[dict]
    text: str
    finish: str

    @classmethod
    def of(cls, payloads: Sequence[dict]) -> Reply:
        # No prompt_ids only if the stream was cancelled before the server rendered the messages.
        start = next((len(p["prompt_ids"]) for p in payloads if "prompt_ids" in p), 0)
        tokens = [p for p in payloads if "token" in p and not p.get("prompt") and not is_end_of_turn(p)]
        return cls(start, tokens, "".join(p.get("text", "") for p in tokens), payloads[-1]["finish_reason"])

    @property
    def kept(self) -> bool:
        """Whether the turn joins the conversation. A cancelled reply keeps what was said, as a
        chat page keeps a stopped answer, so that /history matches the screen; a reply cancelled
        before any text drops the turn (the question may be asked again). A stream error never
        gets here: the turn is dropped."""
        return self.finish != "cancelled" or bool(self.text)


@dataclass
class ChatMode:
    """Whether lines are chat turns (`on`), and the conversation they add to. `template`: the model
    has a chat template (MODEL_INFO's `chat_template`), None while MODEL_INFO has not said (the
    model is loading)."""

    template: bool | None = None
    on: bool = False
    conversation: Conversation = field(default_factory=Conversation)

    def learn(self, model_info: dict | str) -> bool:
        """Take the template's presence from a MODEL_INFO answer (a string while the model loads);
        the first answer that says starts chat mode on a model with one. True if it said now."""
        if self.template is not None or not isinstance(model_info, dict):
            return False
        self.template = model_info.get("chat_template") is True
        self.on = self.template
        return True

    @property
    def max_tokens(self) -> int:
        return CHAT_MAX_TOKENS if self.on else RAW_MAX_TOKENS

    def describe(self) -> str:
        if self.on:
            return "chat mode: each line is your turn (/raw: plain completion; /system, /reset, /history)"
        if self.template is False:
            return "plain completion: the model has no chat template"
        return "plain completion: each line is a prompt the model continues (/chat: back to the conversation)"

    def command(self, command: str, arg: str) -> str:
        """Act on one of CHAT_COMMANDS; the text to print."""
        conversation = self.conversation
        match command:
            case "/chat":
                if not self.template:
                    return f"[error] {NO_TEMPLATE}" if self.template is False else "[error] the model is still loading"
                self.on = True
                return self.describe()
            case "/raw":
                self.on = False
                return self.describe()
            case "/system":
                if arg == "off":
                    conversation.system = None
                elif arg:
                    conversation.system = arg
                if conversation.system is None:
                    return "no system message (a chat template may add its own)"
                return _entry("system", conversation.system)
            case "/reset":
                conversation.turns.clear()
                return "conversation cleared" + (" (the system message stays)" if conversation.system else "")
            case "/history":
                return "\n".join(conversation.history())
        raise ValueError(f"not a chat command: {command}")

    def add(self, user: str, reply: Reply) -> str | None:
        """Add the turn if the reply keeps it; a note to print when a cancelled reply decides."""
        if reply.kept:
            self.conversation.turns.append(Turn(user, reply.text))
        if reply.finish != "cancelled":
            return None
        return "[the partial reply stays in the conversation]" if reply.kept else "[the turn is dropped]"
