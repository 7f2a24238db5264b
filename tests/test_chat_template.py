"""Chat templates without an engine: the renderer's token ids against transformers' own
`apply_chat_template` on the same messages, the override file, and every refusal."""

from __future__ import annotations

import base64
import re
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from salience.core.engine.chat import ChatRenderer, ChatTemplate, load_chat_template
from salience.core.engine.chat_messages import parse_messages
from salience.core.engine.images import Vision
from salience.errors import FailedPrecondition, InvalidArgument
from tests.images import decode, image_bytes
from tests.tiny_vl_model import CHAT_TEMPLATE as LIST_CONTENT_TEMPLATE

# Qwen2.5's ChatML template without its tools branch: a default system prompt, tool answers as
# <tool_response> blocks inside one user turn.
QWEN2_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# A template that rewrites earlier turns, as reasoning models' templates drop an earlier reply's thinking.
DROPS_EARLIER_REPLIES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REFUSES_A_LEADING_ASSISTANT = (
    "{% if messages[0].role == 'assistant' %}{{ raise_exception('the user speaks first') }}{% endif %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)

CONVERSATIONS = {
    "system and several turns": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Ünïcödé, 数字 42."},
    ],
    "no system message": [{"role": "user", "content": "Hello there"}],
    "tool answers": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Calling the weather tool."},
        {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_1"},
        {"role": "tool", "content": '{"wind": 5}', "tool_call_id": "call_2"},
    ],
}


@pytest.fixture(scope="module")
def smol(default_model: Path):
    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def tiny(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
def qwen2_folder(tiny_model: Path, tmp_path: Path) -> Path:
    """The tiny Qwen2 model's tokenizer, with the Qwen2 template as its own chat_template.jinja."""
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(tiny_model / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(QWEN2_TEMPLATE)
    return tmp_path


def transformers_ids(tokenizer, messages: list[dict], **kwargs) -> tuple[int, ...]:
    """What transformers renders, called as a user of transformers would."""
    return tuple(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)["input_ids"]
    )


@pytest.mark.parametrize("conversation", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_the_default_model_renders_as_transformers(smol, conversation: list[dict]) -> None:
    renderer = ChatRenderer(smol)
    assert renderer.has_template
    ids = renderer.render(parse_messages(conversation))
    assert ids == transformers_ids(smol, conversation)
    assert smol.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")  # the reply begins at len(ids)


def test_the_tokenizer_vllm_gives_the_engine_renders_alike(default_model: Path, smol) -> None:
    """Engine.chat renders with vLLM's tokenizer (a cached subclass of transformers' own)."""
    from vllm.tokenizers import get_tokenizer

    conversation = CONVERSATIONS["system and several turns"]
    engines = ChatRenderer(get_tokenizer(default_model))
    assert engines.render(parse_messages(conversation)) == transformers_ids(smol, conversation)


@pytest.mark.parametrize("conversation", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_a_qwen2_folder_renders_as_transformers(qwen2_folder: Path, conversation: list[dict]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen2_folder)
    ids = ChatRenderer(tokenizer).render(parse_messages(conversation))
    assert ids == transformers_ids(tokenizer, conversation)
    assert "<tool_response>" in tokenizer.decode(ids) or conversation[-1]["role"] != "tool"


def test_the_template_in_tokenizer_config_json_is_the_models_own(qwen2_folder: Path, tiny) -> None:
    """Older folders keep the template in tokenizer_config.json rather than chat_template.jinja."""
    (qwen2_folder / "chat_template.jinja").unlink()
    tokenizer = AutoTokenizer.from_pretrained(qwen2_folder)
    tokenizer.chat_template = QWEN2_TEMPLATE
    tokenizer.save_pretrained(qwen2_folder, save_jinja_files=False)
    assert not (qwen2_folder / "chat_template.jinja").exists()
    reloaded = AutoTokenizer.from_pretrained(qwen2_folder)
    conversation = CONVERSATIONS["system and several turns"]
    assert ChatRenderer(reloaded).render(parse_messages(conversation)) == transformers_ids(
        tiny, conversation, chat_template=QWEN2_TEMPLATE
    )


def test_an_override_file_gives_a_model_without_a_template_one(tiny, tmp_path: Path) -> None:
    path = tmp_path / "qwen2.jinja"
    path.write_text(QWEN2_TEMPLATE)
    renderer = ChatRenderer(tiny, load_chat_template(path))
    conversation = CONVERSATIONS["system and several turns"]
    assert renderer.render(parse_messages(conversation)) == transformers_ids(
        tiny, conversation, chat_template=QWEN2_TEMPLATE
    )


def test_an_override_file_wins_over_the_models_own(smol, tmp_path: Path) -> None:
    path = tmp_path / "qwen2.jinja"
    path.write_text(QWEN2_TEMPLATE)
    conversation = CONVERSATIONS["no system message"]
    ids = ChatRenderer(smol, load_chat_template(path)).render(parse_messages(conversation))
    assert ids == transformers_ids(smol, conversation, chat_template=QWEN2_TEMPLATE)
    assert ids != transformers_ids(smol, conversation)
    assert "You are Qwen" in smol.decode(ids)


def test_a_model_without_a_template_names_the_flag(tiny) -> None:
    renderer = ChatRenderer(tiny)
    assert not renderer.has_template
    with pytest.raises(FailedPrecondition, match="--chat-template FILE"):
        renderer.render(parse_messages(CONVERSATIONS["no system message"]))


def test_text_parts_are_joined_for_a_template_that_reads_strings(smol) -> None:
    """As vLLM's OpenAI server gives them to such a template: one string, parts joined by newlines."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert ChatRenderer(smol).render(parse_messages(parts)) == transformers_ids(smol, joined)


def test_text_parts_stay_a_list_for_a_template_that_reads_lists(tiny) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    renderer = ChatRenderer(tiny, ChatTemplate(text=LIST_CONTENT_TEMPLATE, source="test"))
    assert renderer.render(parse_messages(parts)) == transformers_ids(tiny, parts, chat_template=LIST_CONTENT_TEMPLATE)


def test_a_developer_message_is_a_system_one_for_a_template_without_the_role(smol) -> None:
    developer = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert ChatRenderer(smol).render(parse_messages(developer)) == transformers_ids(smol, system)


def test_without_the_generation_prompt_as_transformers(smol) -> None:
    conversation = CONVERSATIONS["system and several turns"][:3]
    ids = ChatRenderer(smol).render(parse_messages(conversation), add_generation_prompt=False)
    expected = smol.apply_chat_template(conversation, add_generation_prompt=False, tokenize=True)["input_ids"]
    assert ids == tuple(expected)


def test_a_template_that_only_appends_is_told_from_one_that_rewrites_earlier_turns(smol) -> None:
    conversation = parse_messages(CONVERSATIONS["system and several turns"])
    own = ChatRenderer(smol)
    assert own.appends(conversation[:3])  # the assistant's reply after the generation prompt
    assert own.appends(conversation)  # a user turn after the reply
    rewriting = ChatRenderer(smol, ChatTemplate(text=DROPS_EARLIER_REPLIES, source="test"))
    assert rewriting.appends(conversation[:3])
    assert not rewriting.appends(conversation)


def test_the_templates_own_refusal_is_an_invalid_argument(smol) -> None:
    renderer = ChatRenderer(smol, ChatTemplate(text=REFUSES_A_LEADING_ASSISTANT, source="test"))
    with pytest.raises(InvalidArgument, match="the chat template refused the messages: the user speaks first"):
        renderer.render(parse_messages([{"role": "assistant", "content": "Hi"}]))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


IMAGE = {"type": "image_url", "image_url": {"url": data_url(image_bytes("PNG"))}}
LOOKING = [
    {"role": "system", "content": "Describe images."},
    {"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE]},
]


@pytest.fixture(scope="module")
def vl(tiny_vl_model: Path) -> tuple[ChatRenderer, Vision]:
    vision = Vision.load(tiny_vl_model)
    assert vision is not None
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_vl_model), vision=vision), vision


async def test_images_are_placed_where_transformers_processor_puts_them(tiny_vl_model: Path, vl) -> None:
    from transformers import AutoProcessor

    renderer, vision = vl
    second = image_bytes("JPEG", size=(56, 140), seed=3)
    conversation = [
        *LOOKING,
        {"role": "assistant", "content": "A grid."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(second, "image/jpeg")}}]},
    ]
    prompt = await renderer.prompt(parse_messages(conversation))
    processor = AutoProcessor.from_pretrained(tiny_vl_model)
    as_transformers = [  # a processor's own form of the same conversation
        {**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
        if isinstance(m["content"], list)
        else m
        for m in conversation
    ]
    text = processor.apply_chat_template(as_transformers, add_generation_prompt=True, tokenize=False)
    images = [decode(image_bytes("PNG")), decode(second)]
    expected = processor(text=[text], images=images, return_tensors="np")["input_ids"][0].tolist()
    assert list(prompt.tokens) == expected
    assert len(prompt.images) == 2
    for placed, image in zip(prompt.images, images, strict=True):
        assert prompt.tokens[placed.start] == vision.start and prompt.tokens[placed.end - 1] == vision.end
        assert set(prompt.tokens[placed.start + 1 : placed.end - 1]) == {vision.pad}
        assert placed.image.tobytes() == image.convert("RGB").tobytes()


async def test_text_only_messages_need_no_vision(vl) -> None:
    renderer, _ = vl
    prompt = await renderer.prompt(parse_messages([{"role": "user", "content": "Hi"}]))
    assert prompt.images == () and prompt.tokens == renderer.render(parse_messages([{"role": "user", "content": "Hi"}]))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png,rawbytes", "messages[1].content[1].image_url.url must be a base64 data: URL"),
        ("data:image/png;base64,@@@@", "messages[1].content[1].image_url.url: the base64 after the comma does not"),
        (data_url(image_bytes("PNG"), "image/bmp"), "messages[1].content[1]: mime 'image/bmp' is not one of"),
        (data_url(image_bytes("PNG"), "image/jpeg"), "messages[1].content[1]: declared image/jpeg but the bytes are"),
        (data_url(b"not an image"), "messages[1].content[1]: the bytes do not decode as an image"),
    ],
)
async def test_a_bad_image_is_refused_naming_it(vl, url: str, message: str) -> None:
    renderer, _ = vl
    conversation = [LOOKING[0], {"role": "user", "content": [{"type": "text", "text": "?"}, image_url(url)]}]
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        await renderer.prompt(parse_messages(conversation))


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def test_an_image_on_a_text_model_is_refused_naming_it(smol) -> None:
    with pytest.raises(
        InvalidArgument, match=re.escape("messages[1].content[1] is an image, and this model reads only text")
    ):
        await ChatRenderer(smol).prompt(parse_messages(LOOKING))


async def test_a_template_that_reads_strings_has_no_place_for_an_image(smol, vl) -> None:
    _, vision = vl
    with pytest.raises(
        InvalidArgument, match="the chat template reads content as one string, with no place for an image"
    ):
        await ChatRenderer(smol, vision=vision).prompt(parse_messages(LOOKING))


USER = {"role": "user", "content": "Hi"}
BAD_MESSAGES = [
    ([], "messages must hold at least one message"),
    ({"role": "user"}, "messages must be a list of messages"),
    ([USER, USER, {"role": "robot", "content": "beep"}], "messages[2].role must be one of system, developer, user"),
    ([{"content": "Hi"}], "messages[0].role must be one of"),
    (["Hi"], "messages[0] must be an object"),
    ([{"role": "user", "content": "Hi", "tool_calls": []}], "messages[0].tool_calls is only allowed on an assistant"),
    ([{"role": "user", "content": "Hi", "audio": {}}], "messages[0]: unknown field 'audio'"),
    ([{"role": "user"}], "messages[0].content must be a string or a non-empty list of parts"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a non-empty list of parts"),
    ([{"role": "user", "content": []}], "messages[0].content must be a string or a non-empty list of parts"),
    ([{"role": "user", "content": [{"type": "text"}]}], 'messages[0].content[0] must be {"type": "text"'),
    (
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        'messages[0].content[0] must be a text part or an image_url part, got type "input_audio"',
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}],
        "messages[0].content[0].image_url.url is an http(s) URL, and the server fetches nothing",
    ),
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
        "messages[0].content[0].image_url.url must be a data: URL",
    ),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "data:,"}]}], "messages[0].content[0] must be"),
    ([{"role": "user", "content": "Hi", "name": 7}], "messages[0].name must be a string"),
]


@pytest.mark.parametrize(("value", "message"), BAD_MESSAGES)
def test_bad_messages_are_refused_naming_the_field(value, message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_messages(value)
    assert message in str(info.value)


def test_a_template_file_is_read_and_compiled_at_once(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"--chat-template .*missing\.jinja: cannot read it"):
        load_chat_template(tmp_path / "missing.jinja")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }")
    with pytest.raises(InvalidArgument, match=r"--chat-template .*broken\.jinja: line 2"):
        load_chat_template(broken)
