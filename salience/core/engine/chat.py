"""Chat prompts: messages rendered to token ids by the served model's chat template, through
transformers' own `apply_chat_template`, so a client that sends messages gets the ids
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)` gives for them.

The template is the model's own, as transformers reads it from the folder (chat_template.jinja,
or tokenizer_config.json's `chat_template`), unless `--chat-template FILE` overrides it; it is
resolved once, when the engine starts (`Engine.chat`). Messages reach the template in the form
vLLM's OpenAI server gives them, so that both servers render a request alike: text parts joined
with newlines for a template that reads content as a string, developer messages as system ones
for a template that does not name the developer role, a tool call's arguments as an object.

Tools reach the template as transformers passes them (`tools=`, OpenAI's chat form). A template
that ignores them (renders the same with and without; SmolLM2's) is replaced, for a request with
tools or calls, by the fallback `chat_templates/chatml_tools.jinja` (ChatML with Qwen2.5's
Hermes-style tool prompt; docs/openai.md#tools), which is right for ChatML models; another
family's model takes its own tool template with --chat-template. The parser that finds calls in
a reply (`tool_parser`) is --tool-call-parser, or the one the template names (tool_parsers.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2

from salience.core.engine.chat_messages import ChatMessage, ContentPart, ImagePart, TextPart
from salience.core.engine.images import ImageFacts, Vision
from salience.core.engine.prompts import PlacedImage, Prompt
from salience.core.engine.tool_parsers import detect
from salience.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["FALLBACK_TOOLS_TEMPLATE", "ChatRenderer", "ChatTemplate", "load_chat_template"]

FALLBACK_TOOLS_TEMPLATE = Path(__file__).with_name("chat_templates") / "chatml_tools.jinja"
_PROBE_TOOL = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the file it came from."""

    text: str
    source: str


def load_chat_template(path: Path) -> ChatTemplate:
    """A --chat-template file, read and compiled now: a bad file must not wait for the model."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"--chat-template {path}: cannot read it ({exc})") from None
    try:
        _compile_jinja_template(text)  # as apply_chat_template will, with transformers' extensions
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidArgument(f"--chat-template {path}: line {exc.lineno}: {exc.message}") from None
    return ChatTemplate(text=text, source=str(path))


class ChatRenderer:
    """One template for one tokenizer. `vision`: the model's vision side, for a model that reads
    images (None: it reads only text)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        override: ChatTemplate | None = None,
        *,
        vision: Vision | None = None,
        tool_parser: str | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vision = vision
        self.template: str | None = override.text if override is not None else _own_template(tokenizer)
        self._text_as_string = True
        self._developer_role = False
        # The template a request with tools renders with: the model's own, unless it ignores tools.
        self.tools_template: str | None = self.template
        if self.template is not None:
            from vllm.renderers.hf import _detect_content_format, _detect_developer_role_support

            self._text_as_string = _detect_content_format(self.template, default="string") == "string"
            self._developer_role = _detect_developer_role_support(self.template)
            if self._ignores_tools():
                self.tools_template = FALLBACK_TOOLS_TEMPLATE.read_text(encoding="utf-8")
        # vLLM's parser for calls in a reply (None: none known; tool_choice auto cannot be served).
        self.tool_parser: str | None = tool_parser or detect(self.tools_template)

    @property
    def has_template(self) -> bool:
        return self.template is not None

    async def prompt(self, messages: Sequence[ChatMessage], tools: Sequence[Mapping] | None = None) -> Prompt:
        """The conversation as the model reads it, the generation prompt appended: the template's
        ids with each image's one pad expanded to the pads its processor makes of it (as
        transformers' processor expands them), and the images placed in their blocks. Images are
        decoded off the event loop: a large one takes a while. `tools`: the functions the model
        may call, in OpenAI's chat form."""
        ids = self.render(messages, tools=tools)
        parts = [
            (f"messages[{i}].content[{j}]", part)
            for i, message in enumerate(messages)
            if not isinstance(message.content, str)
            for j, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        ]
        if not parts:
            return Prompt(ids)
        vision = self._vision
        assert vision is not None  # render refused the image on a text model
        facts = await asyncio.to_thread(
            lambda: [
                vision.inspect(*_data_url(part.url, f"{where}.image_url.url"), what=where) for where, part in parts
            ]
        )
        return _expand(vision, ids, facts)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping] | None = None,
    ) -> tuple[int, ...]:
        """The conversation's token ids, as the template writes them (one pad per image). With the
        generation prompt (the default) they end where the assistant's reply begins: its first
        token is at position len(ids)."""
        if self.template is None:
            raise FailedPrecondition(
                "this model has no chat template: start the server with --chat-template FILE, or send token ids"
            )
        from vllm.renderers.chat_utils import _postprocess_messages
        from vllm.renderers.hf import _consolidate_system_messages, _convert_developer_to_system

        conversation = [self._as_dict(message, f"messages[{i}]") for i, message in enumerate(messages)]
        if not self._developer_role and any(m["role"] == "developer" for m in conversation):
            conversation = _consolidate_system_messages(_convert_developer_to_system(conversation))
        _postprocess_messages(conversation)  # a call's arguments as an object, as templates read them
        with_tools = bool(tools) or any(message.tool_calls for message in messages)
        try:
            ids = self._tokenizer.apply_chat_template(
                conversation,
                chat_template=self.tools_template if with_tools else self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                tools=[dict(tool) for tool in tools] if tools else None,
            )
        except jinja2.TemplateError as exc:  # the template's own raise_exception: alternation, roles it refuses
            raise InvalidArgument(f"the chat template refused the messages: {exc}") from None
        return tuple(ids)

    def appends(self, messages: Sequence[ChatMessage]) -> bool:
        """Whether adding messages[-1] only appends tokens: the rendering of messages[:-1] (with the
        generation prompt when messages[-1] is the assistant's reply to them) is a prefix of the
        rendering of `messages`. A session that keeps a conversation's tokens can add a turn only
        then; a template that rewrites earlier turns (drops an earlier reply's reasoning, say)
        must be rendered whole every turn."""
        if len(messages) < 2:
            raise ValueError("appends compares the renderings of messages[:-1] and messages: give two or more")
        earlier = self.render(messages[:-1], add_generation_prompt=messages[-1].role == "assistant")
        later = self.render(messages, add_generation_prompt=False)
        return later[: len(earlier)] == earlier

    def _as_dict(self, message: ChatMessage, where: str) -> dict[str, Any]:
        out: dict[str, Any] = {"role": message.role, "content": self._content(message.content, f"{where}.content")}
        if message.name is not None:
            out["name"] = message.name
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in message.tool_calls
            ]
        return out

    def _ignores_tools(self) -> bool:
        """Whether the template writes nothing of a tool it is given (one that fails on the probe
        is taken to read them)."""
        user = [{"role": "user", "content": "probe"}]
        try:
            plain, offered = (
                self._tokenizer.apply_chat_template(user, chat_template=self.template, tokenize=False, tools=tools)
                for tools in (None, [_PROBE_TOOL])
            )
        except Exception:  # a template's own error: not ours to judge here
            return False
        return plain == offered

    def _content(self, content: str | tuple[ContentPart, ...], where: str) -> str | list[dict[str, str]]:
        if isinstance(content, str):
            return content
        for i, part in enumerate(content):
            if isinstance(part, ImagePart) and (self._vision is None or self._text_as_string):
                why = (
                    "this model reads only text"
                    if self._vision is None
                    else "the chat template reads content as one string, with no place for an image"
                )
                raise InvalidArgument(f"{where}[{i}] is an image, and {why}", field=f"{where}[{i}]")
        if self._text_as_string:
            return "\n".join(part.text for part in content if isinstance(part, TextPart))
        # An image is `{"type": "image"}` to the template, as vLLM's server and transformers' processors give it.
        return [
            {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"} for part in content
        ]


def _data_url(url: str, where: str) -> tuple[bytes, str]:
    """A base64 data: URL's bytes and mime type."""
    header, comma, body = url.removeprefix("data:").partition(",")
    mime, *options = header.split(";")
    if not comma or "base64" not in options:
        raise InvalidArgument(f"{where} must be a base64 data: URL (data:image/png;base64,...)", field=where)
    try:
        return base64.b64decode(body, validate=True), mime
    except binascii.Error:
        raise InvalidArgument(f"{where}: the base64 after the comma does not decode", field=where) from None


def _expand(vision: Vision, ids: tuple[int, ...], facts: Sequence[ImageFacts]) -> Prompt:
    """`ids` with the k-th image pad grown to facts[k].pads pads, each in its vision block."""
    pads = [p for p, token in enumerate(ids) if token == vision.pad]
    if len(pads) != len(facts):
        raise InvalidArgument(
            f"the chat template wrote {len(pads)} image pads for the messages' {len(facts)} images: "
            "it cannot place them"
        )
    tokens: list[int] = []
    placed = []
    at = 0
    for p, fact in zip(pads, facts, strict=True):
        if not 0 < p < len(ids) - 1 or (ids[p - 1], ids[p + 1]) != (vision.start, vision.end):
            raise InvalidArgument("the chat template writes an image pad outside <|vision_start|> ... <|vision_end|>")
        tokens += ids[at:p]
        start = len(tokens) - 1
        tokens += [vision.pad] * fact.pads
        placed.append(PlacedImage(start=start, end=len(tokens) + 1, image=fact.image))
        at = p + 1
    tokens += ids[at:]
    return Prompt(tuple(tokens), tuple(placed))


def _own_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The template transformers would use (None without one, or with several and no default)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        return None
