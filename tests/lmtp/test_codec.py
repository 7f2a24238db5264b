"""The LMTP codec alone: no sockets, no engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from salience.core.engine.chat_messages import ChatMessage, ImagePart, TextPart
from salience.core.engine.requests import Constraint, ImageBlock
from salience.core.probes.steering import Intervention, Op
from salience.lmtp.codec import (
    LmtpError,
    msg_frame,
    parse_client_line,
    parse_server_line,
    readout_values,
    token_frame,
)
from salience.lmtp.messages import (
    Cancel,
    CloseSession,
    Detokenize,
    DumpSession,
    ForkSession,
    Generate,
    ImageInfo,
    ModelInfo,
    OpenSession,
    Score,
    SessionGenerate,
    Tokenize,
)
from salience.lmtp.payloads import readout_field

# What LMQL 0.7.3 sends, verbatim, and what it must parse to.
VALID = [
    (
        'GENERATE {"max_tokens": 16, "temperature": 0.8, "logit_bias": {"79": 100, "90": 100}, '
        '"top_logprobs": 1, "model": "NAME", "prompt": [0, 50, 27, 222], "stream_id": 1}',
        Generate(
            stream_id=1,
            prompt=(0, 50, 27, 222),
            model="NAME",
            max_tokens=16,
            temperature=0.8,
            logit_bias={79: 100.0, 90: 100.0},
            top_logprobs=1,
        ),
    ),
    (
        'GENERATE {"prompt": [1], "stream_id": 2, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.1, '
        '"presence_penalty": 0.5, "frequency_penalty": 0.2, "length_penalty": 1.0, "seed": 3, "text": true}',
        Generate(
            stream_id=2,
            prompt=(1,),
            top_p=0.9,
            top_k=-1,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            seed=3,
            text=True,
        ),
    ),
    (
        'SCORE {"model": "NAME", "prompt": [0, 1], "scored": [2, 3], "stream_id": 4}',
        Score(stream_id=4, prompt=(0, 1), scored=(2, 3), model="NAME"),
    ),
    (
        'MODEL_INFO {"stream_id": 5, "model": "NAME", "data": {"model": "NAME"}}',
        ModelInfo(stream_id=5, model="NAME"),
    ),
    ('CANCEL {"stream_id": 6}', Cancel(stream_id=6)),
    ('TOKENIZE {"stream_id": 7, "text": "héllo"}', Tokenize(stream_id=7, text="héllo")),
    ('DETOKENIZE {"stream_id": 8, "tokens": [1, 2]}', Detokenize(stream_id=8, tokens=(1, 2))),
    ('GENERATE {"prompt": [1], "stream_id": 9, "logit_bias": null}', Generate(stream_id=9, prompt=(1,))),
    # Chat messages in place of the prompt: the server renders them with the model's chat template.
    (
        'GENERATE {"stream_id": 19, "messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Hi", "name": "ann"}], "max_tokens": 4}',
        Generate(
            stream_id=19,
            messages=(
                ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="Hi", name="ann"),
            ),
            max_tokens=4,
        ),
    ),
    (
        'GENERATE {"stream_id": 20, "prompt": null, "messages": [{"role": "user", "content": [{"type": "text", '
        '"text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}]}',
        Generate(
            stream_id=20,
            messages=(
                ChatMessage(
                    role="user",
                    content=(TextPart(text="What is this?"), ImagePart(url="data:image/png;base64,iVBO")),
                ),
            ),
        ),
    ),
    (
        'SCORE {"stream_id": 21, "messages": [{"role": "developer", "content": "Answer yes or no."}, '
        '{"role": "user", "content": "Is water wet?"}, {"role": "assistant", "content": "Yes."}, '
        '{"role": "tool", "content": "{}", "tool_call_id": "c1"}], "scored": [5, 6], "readout": [[0, 99]]}',
        Score(
            stream_id=21,
            messages=(
                ChatMessage(role="developer", content="Answer yes or no."),
                ChatMessage(role="user", content="Is water wet?"),
                ChatMessage(role="assistant", content="Yes."),
                ChatMessage(role="tool", content="{}", tool_call_id="c1"),
            ),
            scored=(5, 6),
            readout=((0, 99),),
        ),
    ),
    ('OPEN_SESSION {"stream_id": 10, "model": "NAME"}', OpenSession(stream_id=10, model="NAME")),
    (
        'FORK_SESSION {"stream_id": 11, "session_id": "s", "at_position": 4}',
        ForkSession(stream_id=11, session_id="s", at_position=4),
    ),
    ('DUMP_SESSION {"stream_id": 12, "session_id": "s"}', DumpSession(stream_id=12, session_id="s")),
    ('CLOSE_SESSION {"stream_id": 13, "session_id": "s"}', CloseSession(stream_id=13, session_id="s")),
    (
        'SESSION_GENERATE {"stream_id": 14, "session_id": "s", "offset": 3, "truncating": true, "append": [5], '
        '"max_tokens": 2, "logprobs": [[0, 4]], "top_logprobs": 2, "readout": [[1, 2]], "temperature": 0, '
        '"images": [{"data": "iVBORw==", "mime": "image/png", "start": 3, "end": 9}]}',
        SessionGenerate(
            stream_id=14,
            session_id="s",
            offset=3,
            truncating=True,
            append=(5,),
            max_tokens=2,
            logprobs=((0, 4),),
            top_logprobs=2,
            readout=((1, 2),),
            temperature=0.0,
            images=(ImageBlock(start=3, end=9, data=b"\x89PNG", mime="image/png"),),
        ),
    ),
    (
        'IMAGE_INFO {"stream_id": 15, "data": "iVBORw==", "mime": "image/png"}',
        ImageInfo(stream_id=15, data=b"\x89PNG", mime="image/png"),
    ),
    (
        'GENERATE {"prompt": [1], "stream_id": 16, "steer": [{"direction": "french", "layers": [12], "value": 8}, '
        '{"direction": "code", "layer": 3, "op": "ablate", "positions": "all"}, '
        '{"direction": "names", "layers": "4-6", "op": "set", "value": -2.5, "positions": [[0, 3], [9, 12]]}, '
        '{"direction": "x", "layers": 1, "positions": {"ranges": [[2, 4]], "generated": true}}]}',
        Generate(
            stream_id=16,
            prompt=(1,),
            steer=(
                Intervention(direction="french", layers=(12,), op=Op.ADD, value=8, generated=True),
                Intervention(direction="code", layers=(3,), op=Op.ABLATE, prompt=True, generated=True),
                Intervention(direction="names", layers=(4, 5, 6), op=Op.SET, value=-2.5, ranges=((0, 3), (9, 12))),
                Intervention(direction="x", layers=(1,), op=Op.ADD, ranges=((2, 4),), generated=True),
            ),
        ),
    ),
    (
        'SCORE {"prompt": [1], "scored": [2], "stream_id": 17, "steer": [{"direction": "a", "layers": [0], '
        '"positions": "prompt"}]}',
        Score(
            stream_id=17,
            prompt=(1,),
            scored=(2,),
            steer=(Intervention(direction="a", layers=(0,), op=Op.ADD, prompt=True),),
        ),
    ),
    (
        'SESSION_GENERATE {"stream_id": 18, "session_id": "s", "offset": 0, "steer": [{"direction": "a", '
        '"layers": [0, 2], "op": "set", "value": 1}]}',
        SessionGenerate(
            stream_id=18,
            session_id="s",
            offset=0,
            steer=(Intervention(direction="a", layers=(0, 2), op=Op.SET, value=1, generated=True),),
        ),
    ),
    # vLLM's structured_outputs, read by core's reader (the OpenAI API's too)
    (
        'GENERATE {"prompt": [1], "stream_id": 22, "structured_outputs": {"json": {"type": "object"}, "regex": null}}',
        Generate(
            stream_id=22,
            prompt=(1,),
            structured_outputs=Constraint(kind="json", spec='{"type":"object"}', source="structured_outputs.json"),
        ),
    ),
    (
        'SESSION_GENERATE {"stream_id": 23, "session_id": "s", "offset": 0, "max_tokens": 2, '
        '"structured_outputs": {"choice": ["yes", "no"]}}',
        SessionGenerate(
            stream_id=23,
            session_id="s",
            offset=0,
            max_tokens=2,
            structured_outputs=Constraint(kind="choice", spec=("yes", "no"), source="structured_outputs.choice"),
        ),
    ),
]

INVALID = [
    ("GENERATE", None, "expected 'TYPE <json>'"),
    ("", None, "expected 'TYPE <json>'"),
    ("FROB {}", None, "unknown message type 'FROB'"),
    ("GENERATE {", None, "not valid JSON"),
    ('GENERATE {"stream_id": 12, "prompt": [1,', 12, "not valid JSON"),
    ("GENERATE [1]", None, "must be a JSON object"),
    ('GENERATE {"prompt": [1]}', None, "missing field 'stream_id'"),
    ('GENERATE {"stream_id": 3}', 3, "missing field 'prompt'"),
    ('GENERATE {"stream_id": 3, "prompt": [1, -2]}', 3, "prompt[1] must be a non-negative integer"),
    ('GENERATE {"stream_id": 3, "prompt": [1.5]}', 3, "prompt[0]"),
    ('GENERATE {"stream_id": 3, "prompt": "abc"}', 3, "prompt must be a list"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "temperature": "hot"}', 3, "temperature must be a number"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "temperature": 1e999}', 3, "temperature must be finite"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "max_tokens": 0}', 3, "max_tokens must be >= 1"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "max_tokens": 99999999999999999999}', 3, "max_tokens"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "logit_bias": {"x": 1}}', 3, "logit_bias key 'x'"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "logit_bias": {"-5": 1}}', 3, "logit_bias key '-5'"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "logit_bias": {"5": "lots"}}', 3, "logit_bias[5] must be a number"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "temprature": 1}', 3, "unknown field 'temprature'"),
    ('GENERATE {"stream_id": true, "prompt": [1]}', None, "stream_id must be an integer"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "text": 1}', 3, "text must be true or false"),
    ('SCORE {"stream_id": 3, "prompt": [1]}', 3, "missing field 'scored'"),
    ('GENERATE {"stream_id": 3, "messages": null}', 3, "GENERATE: missing field 'prompt' (or 'messages')"),
    ('SCORE {"stream_id": 3, "scored": [1]}', 3, "SCORE: missing field 'prompt' (or 'messages')"),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "messages": [{"role": "user", "content": "Hi"}]}',
        3,
        "GENERATE: give 'prompt' or 'messages', not both",
    ),
    ('SCORE {"stream_id": 3, "messages": [{"role": "user", "content": "Hi"}]}', 3, "missing field 'scored'"),
    ('GENERATE {"stream_id": 3, "messages": []}', 3, "GENERATE: messages must hold at least one message"),
    ('GENERATE {"stream_id": 3, "messages": {"role": "user"}}', 3, "messages must be a list of messages"),
    (
        'GENERATE {"stream_id": 3, "messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
        3,
        'GENERATE: messages[1].role must be one of system, developer, user, assistant, tool, got "bot"',
    ),
    ('GENERATE {"stream_id": 3, "messages": [{"role": "user"}]}', 3, "messages[0].content must be a string or"),
    (
        'SCORE {"stream_id": 3, "scored": [1], "messages": [{"role": "user", "content": [{"type": "audio"}]}]}',
        3,
        'SCORE: messages[0].content[0] must be a text part or an image_url part, got type "audio"',
    ),
    (
        'GENERATE {"stream_id": 3, "messages": [{"role": "user", "content": [{"type": "image_url", '
        '"image_url": {"url": "https://example.com/cat.png"}}]}]}',
        3,
        "messages[0].content[0].image_url.url is an http(s) URL, and the server fetches nothing",
    ),
    (
        'GENERATE {"stream_id": 3, "messages": [{"role": "assistant", "content": "", "tool_calls": {}}]}',
        3,
        "messages[0].tool_calls must be a list of tool calls",
    ),
    ('CANCEL {"stream_id": "a"}', None, "stream_id must be an integer"),
    ("GENERATE \xff\xfe", None, "not valid JSON"),
    ('SESSION_GENERATE {"stream_id": 3, "session_id": "s"}', 3, "missing field 'offset'"),
    ('SESSION_GENERATE {"stream_id": 3, "session_id": "s", "offset": -1}', 3, "offset must be >= 0"),
    (
        'SESSION_GENERATE {"stream_id": 3, "session_id": "s", "offset": 0, "images": [{"data": "!!"}]}',
        3,
        "images[0] must be",
    ),
    (
        'SESSION_GENERATE {"stream_id": 3, "session_id": "s", "offset": 0, '
        '"images": [{"data": "!!", "mime": "image/png", "start": 0, "end": 3}]}',
        3,
        "images[0].data is not valid base64",
    ),
    ('IMAGE_INFO {"stream_id": 3, "data": 5, "mime": "image/png"}', 3, "data must be a base64 string"),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "structured_outputs": {"regex": "a", "choice": ["b"]}}',
        3,
        "GENERATE: structured_outputs must hold exactly one of json, regex, choice, grammar, json_object; "
        "got regex and choice",
    ),
    ('GENERATE {"stream_id": 3, "prompt": [1], "structured_outputs": {"choice": []}}', 3, "structured_outputs.choice"),
    (
        'SESSION_GENERATE {"stream_id": 3, "session_id": "s", "offset": 0, "structured_outputs": {"grammar": ""}}',
        3,
        "SESSION_GENERATE: structured_outputs.grammar must be a non-empty string",
    ),
    ('FORK_SESSION {"stream_id": 3, "session_id": "s"}', 3, "missing field 'at_position'"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "steer": {"direction": "a"}}', 3, "steer must be a list"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "steer": [5]}', 3, "steer[0] must be an object"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"layers": [1]}]}', 3, "steer[0]: direction must be a name"),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a", "layers": [1], "op": "mul"}]}',
        3,
        "steer[0]: op must be one of ['add', 'set', 'ablate', 'cap'], got 'mul'",
    ),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a", "layers": [1], "alpha": 2}]}',
        3,
        "steer[0]: unknown field 'alpha'",
    ),
    ('GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a"}]}', 3, "steer[0]: layers must be"),
    ('GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a", "layers": "6-4"}]}', 3, "layer range"),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a", "layers": 1, "layer": 1}]}',
        3,
        "give layer or layers, not both",
    ),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a", "layers": 1, "value": "big"}]}',
        3,
        "steer[0]: value must be a number",
    ),
    (
        'GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"direction": "a", "layers": 1, "positions": "most"}]}',
        3,
        "positions must be one of ['generated', 'prompt', 'all'] or ranges",
    ),
    (
        'SCORE {"stream_id": 3, "prompt": [1], "scored": [2], "steer": [{"direction": "a", "layers": 1, '
        '"positions": [[1]]}]}',
        3,
        "steer[0]: range 0 must be [start, end]",
    ),
    (
        'SESSION_GENERATE {"stream_id": 3, "session_id": "s", "offset": 0, "steer": ['
        + ", ".join(['{"direction": "a", "layers": 1}'] * 17)
        + "]}",
        3,
        "steer has 17 interventions; at most 16 are allowed per request",
    ),
]


@pytest.mark.parametrize(("line", "expected"), VALID)
@pytest.mark.parametrize("form", ["str", "bytes", "crlf"])
def test_valid_lines_parse(line: str, expected, form: str) -> None:
    data = {"str": line, "bytes": line.encode(), "crlf": line + "\r\n"}[form]
    assert parse_client_line(data) == expected


@pytest.mark.parametrize(("line", "stream_id", "message"), INVALID)
def test_invalid_lines_raise_specific_errors(line: str, stream_id: int | None, message: str) -> None:
    with pytest.raises(LmtpError) as info:
        parse_client_line(line)
    assert message in info.value.message
    assert info.value.stream_id == stream_id


def test_frames_round_trip() -> None:
    payloads = [{"token": 5, "stream_id": 1, "logprob": -0.5, "finish_reason": None, "top_logprobs": {"5": -0.5}}]
    assert parse_server_line(token_frame(payloads)) == ("TOKEN", payloads)
    assert parse_server_line(msg_frame([{"stream_id": 2, "model_info": "x"}])) == (
        "MSG",
        [{"stream_id": 2, "model_info": "x"}],
    )
    assert "\n" not in token_frame([{"text": "a\nb"}])


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_anything_but_lmtp_errors(data: bytes) -> None:
    try:
        parse_client_line(data)
    except LmtpError as exc:
        assert exc.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(
    [
        "stream_id",
        "prompt",
        "max_tokens",
        "temperature",
        "logit_bias",
        "top_logprobs",
        "model",
        "scored",
        "messages",
        "text",
        "top_k",
    ]
)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["GENERATE", "SCORE", "MODEL_INFO", "CANCEL", "TOKENIZE"]), st.dictionaries(fields, json_values))
def test_odd_but_valid_json_gets_a_message_or_an_error(kind: str, body: dict) -> None:
    line = kind + " " + json.dumps(body)
    try:
        message = parse_client_line(line)
    except LmtpError as exc:
        assert exc.message.startswith(kind)
        if type(body.get("stream_id")) is int and abs(body["stream_id"]) < 2**63:
            assert exc.stream_id == body["stream_id"]
    else:
        assert type(message).__name__.upper().replace("INFO", "_INFO") == kind


# ---- messages over the limit: not parsed, but named (type and stream_id) -----------------------

LIMIT = 64 * 1024


def big_generate(where: str, stream_id: int = 7, size: int = 100 * 1024) -> str:
    """A GENERATE of about `size` bytes with its stream_id at the start, in the middle (before a
    second long list), at the end (where LMQL writes it), or absent."""
    field = f'"stream_id": {stream_id}'
    half = "1, " * (size // 6)
    fields = {
        "start": [field, f'"prompt": [{half}{half}1]'],
        "middle": [f'"prompt": [{half}1]', field, f'"stop_token_ids": [{half}1]'],
        "end": ['"model": "stream_id"', f'"prompt": [{half}{half}1]', field],
        "absent": [f'"prompt": [{half}{half}1]'],
    }[where]
    return "GENERATE {" + ", ".join(fields) + "}"


def oversized_message(kind: str, size: int, limit: int = LIMIT) -> str:
    return f"{kind} message of {size} bytes exceeds the limit of {limit} bytes (--lmtp-max-message-bytes)"


@pytest.mark.parametrize("form", ["str", "bytes"])
@pytest.mark.parametrize(("where", "stream_id"), [("start", 7), ("middle", -3), ("end", 123456789), ("absent", None)])
def test_a_message_over_the_limit_is_named_not_parsed(form: str, where: str, stream_id: int | None) -> None:
    line = big_generate(where, stream_id if stream_id is not None else 0)
    with pytest.raises(LmtpError) as info:
        parse_client_line(line if form == "str" else line.encode(), LIMIT)
    assert info.value.message == oversized_message("GENERATE", len(line))
    assert (info.value.kind, info.value.stream_id) == ("GENERATE", stream_id)


def test_the_limit_is_inclusive_and_counts_utf8_bytes() -> None:
    head = 'TOKENIZE {"stream_id": 4, "text": "'
    fill = LIMIT - len(head) - 2
    exact = head + "x" * fill + '"}'
    assert len(exact.encode()) == LIMIT
    assert parse_client_line(exact, LIMIT) == Tokenize(stream_id=4, text="x" * fill)
    accented = head + "é" * (fill // 2 + 1) + '"}'  # fewer characters than the limit, more bytes
    assert len(accented) < LIMIT < len(accented.encode())
    with pytest.raises(LmtpError) as info:
        parse_client_line(accented, LIMIT)
    assert info.value.message == oversized_message("TOKENIZE", len(accented.encode()))
    assert (info.value.kind, info.value.stream_id) == ("TOKENIZE", 4)


def test_a_stream_id_cut_by_a_search_window_is_read_whole() -> None:
    for pad in range(4070, 4100):  # the key or its number straddles the first 4 KB
        line = (
            'SCORE {"model": "'
            + "m" * pad
            + '", "stream_id": 98765, "prompt": ['
            + "1, " * 30000
            + '1], "scored": [1]}'
        )
        with pytest.raises(LmtpError) as info:
            parse_client_line(line, LIMIT)
        assert (info.value.kind, info.value.stream_id) == ("SCORE", 98765)


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("FROB " + "x" * LIMIT, None),  # an unknown type is not named
        ("x" * (LIMIT + 1), None),  # nor is a line with no type at all
        ('GENERATE {"prompt": [' + "1, " * 30000 + '1], "stream_id": true}', "GENERATE"),  # no integer id
    ],
)
def test_an_oversized_message_without_a_stream_id_is_a_connection_error(line: str, kind: str | None) -> None:
    with pytest.raises(LmtpError) as info:
        parse_client_line(line, LIMIT)
    assert info.value.message == oversized_message(kind or "", len(line)).lstrip()
    assert (info.value.kind, info.value.stream_id) == (kind, None)


def test_the_default_limit_is_16_mib() -> None:
    line = big_generate("end", 5, size=16 * 2**20)
    with pytest.raises(LmtpError) as info:
        parse_client_line(line)
    assert info.value.message == oversized_message("GENERATE", len(line), 16 * 2**20)
    assert info.value.stream_id == 5


@given(st.lists(st.one_of(st.none(), st.floats(allow_nan=False, width=64)), max_size=200))
def test_f32_readouts_carry_what_float32_holds(values: list[float | None]) -> None:
    """The packing fast path and numpy's agree: each value as float32 (beyond its range, inf), a
    None (a probability without calibration) as NaN."""
    with np.errstate(over="ignore"):
        expected = np.array([np.nan if v is None else v for v in values], dtype=np.float32)
    got = np.array(readout_values(readout_field(tuple(values), "f32")), dtype=np.float32)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('GENERATE {"stream_id": 3, "prompt": [1], "temperature": "hot"}', "temperature"),
        ('GENERATE {"stream_id": 3, "prompt": [1, -2]}', "prompt[1]"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "logit_bias": {"5": "lots"}}', "logit_bias[5]"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "temprature": 1}', "temprature"),
        ('GENERATE {"stream_id": 3}', "prompt"),
        ('SCORE {"stream_id": 3, "prompt": [1]}', "scored"),
        ('GENERATE {"stream_id": 3, "messages": [{"role": "bot", "content": "b"}]}', "messages[0].role"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "steer": [{"layers": [1]}]}', "steer[0]"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "readout": [[1]]}', "readout[0]"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "features": {"k": 2, "sae": 5}}', "features.sae"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "structured_outputs": {"choice": []}}', "structured_outputs.choice"),
        ('GENERATE {"stream_id": 3, "prompt": [1], "request_id": ""}', "request_id"),
        ('SESSION_GENERATE {"stream_id": 3, "session_id": "s", "offset": -1}', "offset"),
        ("GENERATE {", None),  # the line as a whole
    ],
)
def test_an_error_names_its_field(line: str, field: str | None) -> None:
    with pytest.raises(LmtpError) as info:
        parse_client_line(line)
    assert info.value.field == field, info.value.message
