"""Chat in sessions (ChatGenerate) over a real channel: the session's tokens against transformers'
`apply_chat_template` of the whole conversation, templates that rewrite earlier turns, the
conversation through forks, rewinds and cancels, and every refusal leaving the session as it was."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from salience.core.engine.chat import ChatRenderer, ChatTemplate
from salience.core.engine.chat_messages import ChatMessage
from salience.core.engine.engine import Engine
from salience.core.serving.sessions import SessionStore
from salience.core.serving.status import ServerStatus
from salience.grpc_frontend.chat import chat_message, chat_messages
from salience.grpc_frontend.client import AsyncSalienceClient, AsyncSession
from salience.grpc_frontend.ledger import ChatResult, chat_message_proto
from salience.grpc_frontend.server import start_grpc_server
from salience.proto.salience.ext.v1 import extensions_pb2 as ext
from salience.proto.salience.ext.v1 import extensions_pb2_grpc
from salience.proto.salience.v1 import salience_pb2 as pb
from tests.engines import settled
from tests.grpc.conftest import MODEL, Served
from tests.grpc.test_service import status_of

Done = pb.GenerateDone

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites the last reply once a turn follows it, as reasoning models' templates drop its thinking.
DROPS_EARLIER_REPLIES = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites the conversation's first tokens whenever a message is added.
COUNTS_MESSAGES = "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + CHATML


def user(text: str) -> dict:
    return {"role": "user", "content": text}


async def raw_chat(target: str, session_id: str, offset: int, messages: list, **generate) -> ChatResult:
    """One ChatGenerate as a client might write it, not as the Python client would."""
    request = ext.ChatGenerateRequest(
        turn=ext.ExtendedGenerateRequest(generate=pb.GenerateRequest(session_id=session_id, offset=offset, **generate)),
        messages=[chat_message_proto(m) for m in messages],
    )
    async with grpc.aio.insecure_channel(target) as channel:
        result = ChatResult()
        async for event in extensions_pb2_grpc.SalienceExtensionsStub(channel).ChatGenerate(request):
            result.add_chat(event)
    return result


def conversation(*turns: tuple[list[dict], ChatResult]) -> list[dict]:
    """The messages sent and the replies received, in order."""
    messages = []
    for sent, result in turns:
        messages += [*sent, {"role": "assistant", "content": result.reply.content}]
    return messages


def rendered(tokenizer, messages: list[dict], template: str | None = None, generation_prompt: bool = True) -> list[int]:
    """What transformers renders, called as a user of transformers would."""
    kwargs = {} if template is None else {"chat_template": template}
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **kwargs)[
            "input_ids"
        ]
    )


def assert_accounted(result: ChatResult, before: int, dump: list[int], session: AsyncSession) -> None:
    """The turn's numbers add up: the append where the Done says decoding began, every decoded
    token at its position, the session exactly that long, and the client's ledger agreeing."""
    start = result.offset + len(result.appended)
    assert session.length == len(dump)
    assert result.offset <= before
    assert (result.done.prompt_tokens, result.done.completion_tokens) == (start, len(result.tokens))
    assert result.done.total_tokens == len(dump) == start + len(result.tokens)
    assert [t.position for t in result.tokens] == list(range(start, len(dump)))
    assert dump[result.offset : start] == result.appended and dump[start:] == result.token_ids


# ---- the default model: SmolLM2's ChatML template, exactly as transformers renders it ----------


@pytest_asyncio.fixture(scope="module")
async def smol_target(default_engine: Engine, default_model: Path) -> AsyncIterator[str]:
    status = ServerStatus(default_model.name)
    status.ready(default_engine)
    server = await start_grpc_server(status, SessionStore(status.serving_engine), "127.0.0.1", 0)
    await server.serving(True)
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.stop(0)


async def test_two_turns_are_the_template_rendering_of_the_conversation(
    smol_target: str, default_model: Path, default_engine: Engine
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    async with AsyncSalienceClient(smol_target) as client:
        session = await client.open_session(default_model.name)
        first_sent = [user("What is the capital of France? Answer in one sentence.")]
        first = await session.chat(first_sent, max_tokens=48, top_k=1)
        assert (first.offset, first.appended) == (0, rendered(tokenizer, first_sent))
        assert first.done.finish_reason == Done.FINISH_REASON_EOS and first.token_ids[-1] == tokenizer.eos_token_id
        assert "Paris" in first.reply.content and first.reply.role == "assistant"
        assert first.reply.content == tokenizer.decode(first.token_ids[:-1])  # without <|im_end|>
        dump = await session.dump()
        assert_accounted(first, 0, dump, session)

        # Only what the template writes after <|im_end|> is appended: "\n" and the next turn.
        second_sent = [user("And of Italy?")]
        second = await session.chat(
            second_sent,
            max_tokens=48,
            top_k=1,
            readout_ranges=[(len(dump), None)],
            readout_format=ext.ExtendedGenerateRequest.READOUT_FORMAT_PROBABILITY,
        )
        assert second.offset == len(dump) and tokenizer.decode(second.appended).startswith("\n<|im_start|>user\n")
        assert "Rome" in second.reply.content
        before, dump = len(dump), await session.dump()
        assert_accounted(second, before, dump, session)
        whole = conversation((first_sent, first), (second_sent, second))
        assert dump == rendered(tokenizer, whole, generation_prompt=False)[:-1]  # all but the "\n" after the reply
        # The open range covers every new position, prompt and reply, with probabilities.
        manifest = default_engine.readouts.manifest
        covered = second.prefill + second.tokens
        assert [t.position for t in covered] == list(range(before, len(dump)))
        assert all(len(t.readout) == len(manifest.layers) * len(manifest.concepts) for t in covered)
        assert all(0.0 <= p <= 1.0 for t in covered for p in t.readout)


# ---- the tiny model, under test templates ------------------------------------------------------


@pytest.fixture
def template(served: Served, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Serve the tiny model (which has no template) with a test template, for one test."""

    def use(text: str) -> None:
        monkeypatch.setattr(served.engine, "chat", ChatRenderer(served.engine.tokenizer, ChatTemplate(text, "test")))

    return use


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


async def test_each_turn_is_the_rendering_of_the_conversation(
    client: AsyncSalienceClient, template, tiny_tokenizer
) -> None:
    """The tiny model stops at <|endoftext|> or max_tokens, never at the template's <|im_end|>, and
    its random tokens may be split as the tokenizer would not split their text: where the next
    rendering parts from its reply, the server re-renders that reply, never anything before it."""
    template(CHATML)
    session = await client.open_session(MODEL)
    turns = []
    for text in ("first question", "second question", "third question", "fourth question"):
        sent = [user(text)]
        before = session.length
        result = await session.chat(sent, max_tokens=12, top_k=1)
        assert_accounted(result, before, await session.dump(), session)
        if turns:
            assert turns[-1][1].done.prompt_tokens <= result.offset <= before
        turns.append((sent, result))
        # Up to the reply, the session is exactly transformers' rendering of the conversation.
        history = conversation(*turns)[:-1]
        assert (await session.dump())[: result.done.prompt_tokens] == rendered(tiny_tokenizer, history, CHATML)
    rerendered = [b.offset < a.done.total_tokens for (_, a), (_, b) in itertools.pairwise(turns)]
    assert any(rerendered)  # the path this test is about was taken


async def test_a_template_that_rewrites_the_last_reply_is_rerendered(
    client: AsyncSalienceClient, template, tiny_tokenizer
) -> None:
    template(DROPS_EARLIER_REPLIES)
    session = await client.open_session(MODEL)
    first = await session.chat([user("hello")], max_tokens=6, top_k=1)
    second = await session.chat([user("again")], max_tokens=6, top_k=1)
    assert second.offset == first.done.prompt_tokens  # the reply, now "(earlier reply)", replaced whole
    history = conversation(([user("hello")], first), ([user("again")], second))[:-1]
    dump = await session.dump()
    assert dump[: second.done.prompt_tokens] == rendered(tiny_tokenizer, history, DROPS_EARLIER_REPLIES)
    assert_accounted(second, first.done.total_tokens, dump, session)


async def test_a_template_that_rewrites_an_earlier_turn_is_refused(
    client: AsyncSalienceClient, template, tiny_tokenizer
) -> None:
    template(COUNTS_MESSAGES)
    session = await client.open_session(MODEL)
    first = await session.chat([user("hello")], max_tokens=4, top_k=1)
    dump = await session.dump()
    code, details = await status_of(session.chat([user("again")], max_tokens=4))
    assert code is grpc.StatusCode.FAILED_PRECONDITION, details
    now = rendered(tiny_tokenizer, [*conversation(([user("hello")], first)), user("again")], COUNTS_MESSAGES)
    changed = next(p for p, (a, b) in enumerate(zip(dump, now, strict=False)) if a != b)
    assert tiny_tokenizer.decode(now[:changed]) == "<|im_start|>system\n"  # "1 messages" became "3 messages"
    assert f"renders the conversation differently from the session's tokens at position {changed}" in details
    assert "in the turn of messages[0] to messages[1]" in details
    assert "the template changes an earlier turn when one is added" in details and "open a new session" in details
    assert await session.dump() == dump and session.length == len(dump)


async def test_tokens_appended_outside_the_chat(client: AsyncSalienceClient, template) -> None:
    template(CHATML)
    session = await client.open_session(MODEL)
    first = await session.chat([user("hello")], max_tokens=4, top_k=1)
    await session.generate([5, 6])  # raw tokens the template would not write
    dump = await session.dump()
    code, details = await status_of(session.chat([user("again")]))
    assert code is grpc.StatusCode.FAILED_PRECONDITION
    assert f"tokens were appended outside the chat from position {first.done.total_tokens} on" in details
    assert await session.dump() == dump
    # A rewind to the end of the chat turn (Generate with truncating) lets the chat go on.
    await session.generate([], truncate_to=first.done.total_tokens)
    again = await session.chat([user("again")], max_tokens=4, top_k=1)
    assert_accounted(again, first.done.total_tokens, await session.dump(), session)


async def test_forks_keep_the_turns_whose_tokens_they_keep(
    client: AsyncSalienceClient, template, tiny_tokenizer
) -> None:
    template(CHATML)
    session = await client.open_session(MODEL)
    first = await session.chat([user("one")], max_tokens=4, top_k=1)
    second = await session.chat([user("two")], max_tokens=4, top_k=1)
    # A fork where the first turn ends goes on from it with another second question.
    branch = await session.fork(second.offset + 2)  # the template ends a reply with <|im_end|>\n
    other = await branch.chat([user("two, otherwise")], max_tokens=4, top_k=1)
    history = conversation(([user("one")], first), ([user("two, otherwise")], other))[:-1]
    assert (await branch.dump())[: other.done.prompt_tokens] == rendered(tiny_tokenizer, history, CHATML)
    # A fork inside the second turn keeps the first, and tokens that are not its rendering.
    inside = await session.fork(second.done.prompt_tokens)
    code, details = await status_of(inside.chat([user("three")]))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "appended outside the chat from position" in details
    assert len(await inside.dump()) == second.done.prompt_tokens


async def test_a_cancelled_reply_is_kept_as_far_as_it_went(
    served: Served, client: AsyncSalienceClient, template, tiny_tokenizer
) -> None:
    template(CHATML)
    session = await client.open_session(MODEL)
    seen = 0
    async for _event in session.chat_stream([user("go on and on")], max_tokens=500, top_k=1):
        seen += 1
        if seen == 4:
            break  # cancels the call
    assert await settled(served.engine) == 0
    dump = await session.dump()
    reply_start = len(rendered(tiny_tokenizer, [user("go on and on")], CHATML))
    assert len(dump) > reply_start
    following = await session.chat([user("next")], max_tokens=3, top_k=1)
    assert following.offset >= reply_start  # the reply joined the conversation as far as it went
    kept = {"role": "assistant", "content": tiny_tokenizer.decode(dump[reply_start:])}
    history = [user("go on and on"), kept, user("next")]
    assert (await session.dump())[: following.done.prompt_tokens] == rendered(tiny_tokenizer, history, CHATML)


async def test_readouts_and_logprobs_over_a_chat_turn_are_the_cores(
    served: Served, client: AsyncSalienceClient, template
) -> None:
    template(CHATML)
    session = await client.open_session(MODEL)
    result = await session.chat(
        [user("read me")], max_tokens=4, top_k=1, readout_ranges=[(3, None)], logprobs_ranges=[(3, None)]
    )
    dump = await session.dump()
    covered = result.prefill + result.tokens
    assert [t.position for t in covered] == list(range(3, len(dump)))
    core = await served.engine.readout(dump, [(3, len(dump))])
    scored = await served.engine.score(dump[:3], dump[3:])
    for token, want in zip(covered, scored, strict=True):
        assert list(token.readout) == pytest.approx(core[token.position], rel=1e-5, abs=1e-5)
        assert token.has_sampled_logprob and token.sampled_logprob == pytest.approx(want.logprob, abs=1e-4)


async def test_refusals_name_the_field_and_change_nothing(
    served: Served, client: AsyncSalienceClient, template
) -> None:
    session = await client.open_session(MODEL)
    code, details = await status_of(session.chat([user("hi")]))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "no chat template" in details
    assert "--chat-template" in details

    template(CHATML)
    await session.chat([user("hello")], max_tokens=3, top_k=1)
    dump = await session.dump()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    wizard = [user("a"), {"role": "wizard", "content": "b"}]
    both = [ext.ChatMessage(role="user", content="a", parts=[ext.ContentPart(text="b")])]
    invalid, failed = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    cases = [
        (wizard, {}, invalid, 'messages[1].role must be one of system, developer, user, assistant, tool, got "wizard"'),
        ([], {}, invalid, "messages must hold at least one message"),
        ([{"role": "user", "content": [{"type": "text", "text": "see"}, image]}], {}, invalid,
         "messages[0].content[1] is an image, and this model reads only text"),
        (both, {}, invalid, "messages[0]: content and parts are exclusive"),
        ([user("a")], {"append_tokens": [1]}, invalid, "takes no append_tokens, images or truncating"),
        ([user("a")], {"offset": 2}, failed, f"offset 2 does not match the session's length {len(dump)}"),
        ([user("a")], {"max_tokens": 5000}, grpc.StatusCode.RESOURCE_EXHAUSTED, "exceed the model's context"),
        ([user("a")], {"session_id": "nope"}, grpc.StatusCode.NOT_FOUND, "no session 'nope'"),
    ]  # fmt: skip
    other = await client.open_session(MODEL)
    beside = asyncio.create_task(other.generate([0, *range(100, 140)], max_tokens=24, top_k=1))
    for messages, fields, code, message in cases:
        fields = {"session_id": session.id, "offset": len(dump), **fields}
        got = await status_of(
            raw_chat(served.target, fields.pop("session_id"), fields.pop("offset"), messages, **fields)
        )
        assert got[0] is code and message in got[1], (message, got)
    assert await session.dump() == dump  # nothing above changed it
    assert (await beside).done.completion_tokens == 24  # nor the stream beside it
    again = await session.chat([user("still here")], max_tokens=3, top_k=1)
    assert_accounted(again, len(dump), await session.dump(), session)


def test_a_chat_message_keeps_its_parts() -> None:
    sent = [
        chat_message_proto({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        chat_message_proto({"role": "tool", "content": "{}", "tool_call_id": "call_1", "name": "weather"}),
    ]
    messages = chat_messages(sent)
    assert messages[1] == ChatMessage(role="tool", content="{}", name="weather", tool_call_id="call_1")
    assert [chat_message(m) for m in messages] == sent
