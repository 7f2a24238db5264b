"""The OpenAI API's sans-IO modules: no sockets, no engine.

Requests: one table of bad bodies, each with the status, type and param OpenAI's contract gives
it. Responses: built from TokenEvents and parsed back by the official `openai` package's models,
as a client built on it would. SSE framing: read by the `openai` package's own decoder.
"""

from __future__ import annotations

import math

import numpy as np
import openai
import orjson
import pytest
from openai._streaming import SSEDecoder
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from salience import errors
from salience.core.engine.chat_messages import ChatMessage
from salience.core.engine.requests import Constraint, FinishReason, TokenEvent
from salience.core.probes.live import ConceptView
from salience.core.probes.monitors import Action, Monitor, MonitorEvent
from salience.core.probes.patching import Patch
from salience.core.probes.steering import Intervention, Op
from salience.openai.choices import Choice
from salience.openai.errors import ApiError, from_salience, naming, unauthorized
from salience.openai.extension import Extension, Features, Readouts, parse_extension
from salience.openai.readings import Readings, layout
from salience.openai.requests import CHAT, COMPLETION, Sampling, parse_chat, parse_completion
from salience.openai.responses import DONE, Chunks, Collected, Logprobs, response, usage
from salience.openai.tokens import TokenText

# ---- requests -------------------------------------------------------------------------------

CHAT_BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION_BASE = {"model": "m", "prompt": "hi"}

# (endpoint, body, status, param); every one is type invalid_request_error.
BAD = [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    (CHAT, {**CHAT_BASE, "model": 3}, "model"),
    (CHAT, {"model": "m"}, "messages"),
    (CHAT, {**CHAT_BASE, "messages": []}, "messages"),
    (CHAT, {**CHAT_BASE, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": "a"}, {"role": "x"}]}, "messages[1].role"),
    (CHAT, {**CHAT_BASE, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {**CHAT_BASE, "temperature": 2.5}, "temperature"),
    (CHAT, {**CHAT_BASE, "temperature": "hot"}, "temperature"),
    (CHAT, {**CHAT_BASE, "temperature": True}, "temperature"),
    (CHAT, {**CHAT_BASE, "top_p": 1.5}, "top_p"),
    (CHAT, {**CHAT_BASE, "presence_penalty": -3}, "presence_penalty"),
    (CHAT, {**CHAT_BASE, "frequency_penalty": 2.1}, "frequency_penalty"),
    (CHAT, {**CHAT_BASE, "n": 0}, "n"),
    (CHAT, {**CHAT_BASE, "n": 129}, "n"),
    (CHAT, {**CHAT_BASE, "seed": 1.5}, "seed"),
    (CHAT, {**CHAT_BASE, "seed": 2**63 - 1, "n": 2}, "seed"),
    (CHAT, {**CHAT_BASE, "max_tokens": 0}, "max_tokens"),
    (CHAT, {**CHAT_BASE, "max_completion_tokens": -1}, "max_completion_tokens"),
    (CHAT, {**CHAT_BASE, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (CHAT, {**CHAT_BASE, "stop": [""]}, "stop"),
    (CHAT, {**CHAT_BASE, "stop": 3}, "stop"),
    (CHAT, {**CHAT_BASE, "logit_bias": {"5": 101}}, "logit_bias[5]"),
    (CHAT, {**CHAT_BASE, "logit_bias": {"x": 1}}, "logit_bias"),
    (CHAT, {**CHAT_BASE, "logit_bias": [1]}, "logit_bias"),
    (CHAT, {**CHAT_BASE, "logprobs": 1}, "logprobs"),
    (CHAT, {**CHAT_BASE, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT, {**CHAT_BASE, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {**CHAT_BASE, "stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {**CHAT_BASE, "stream": True, "stream_options": {"usage": True}}, "stream_options"),
    (CHAT, {**CHAT_BASE, "stream": "yes"}, "stream"),
    (CHAT, {**CHAT_BASE, "frobnicate": 1}, "frobnicate"),
    (CHAT, {**CHAT_BASE, "prompt": "hi"}, "prompt"),
    (CHAT, {**CHAT_BASE, "guided_json": {}}, "guided_json"),  # vLLM's old spelling: unknown
    (
        CHAT,
        {**CHAT_BASE, "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    (CHAT, {**CHAT_BASE, "tool_choice": "required"}, "tool_choice"),  # no tools to call
    # vLLM's extras, with vLLM's types and ranges (the core checks what depends on the model)
    (CHAT, {**CHAT_BASE, "top_k": -2}, "top_k"),
    (CHAT, {**CHAT_BASE, "top_k": 1.5}, "top_k"),
    (CHAT, {**CHAT_BASE, "min_p": 1.5}, "min_p"),
    (CHAT, {**CHAT_BASE, "repetition_penalty": "high"}, "repetition_penalty"),
    (CHAT, {**CHAT_BASE, "min_tokens": -1}, "min_tokens"),
    (CHAT, {**CHAT_BASE, "ignore_eos": 1}, "ignore_eos"),
    (CHAT, {**CHAT_BASE, "stop_token_ids": [-1]}, "stop_token_ids"),
    (CHAT, {**CHAT_BASE, "stop_token_ids": 5}, "stop_token_ids"),
    (CHAT, {**CHAT_BASE, "include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    (CHAT, {**CHAT_BASE, "skip_special_tokens": 0}, "skip_special_tokens"),
    # response_format: OpenAI's three types
    (CHAT, {**CHAT_BASE, "response_format": "json"}, "response_format.type"),
    (CHAT, {**CHAT_BASE, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {**CHAT_BASE, "response_format": {"type": "structural_tag", "format": {}}}, "response_format.type"),
    (CHAT, {**CHAT_BASE, "response_format": {"type": "text", "schema": {}}}, "response_format.schema"),
    (CHAT, {**CHAT_BASE, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "{"}}},
        "response_format.json_schema.schema",
    ),
    (
        CHAT,
        {
            **CHAT_BASE,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
        },
        "response_format.json_schema.strict",
    ),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "x": 1}}},
        "response_format.json_schema.x",
    ),
    # structured_outputs: vLLM's object, read by core's reader
    (CHAT, {**CHAT_BASE, "structured_outputs": "regex"}, "structured_outputs"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {}}, "structured_outputs"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"regex": "a" * 65537}}, "structured_outputs.regex"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"grammar": "  "}}, "structured_outputs.grammar"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"json": 5}}, "structured_outputs.json"),
    (CHAT, {**CHAT_BASE, "structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    (
        CHAT,
        {**CHAT_BASE, "structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
        "structured_outputs.disable_any_whitespace",
    ),
    (
        CHAT,
        {**CHAT_BASE, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    (CHAT, {**CHAT_BASE, "salience": []}, "salience"),
    (CHAT, {**CHAT_BASE, "salience": {"readout": {}}}, "salience.readout"),
    (CHAT, {**CHAT_BASE, "salience": {"zeta": 1, "alpha": 2}}, "salience.alpha"),
    (CHAT, {**CHAT_BASE, "salience": {"readouts": {"format": "logit"}}}, "salience.readouts.format"),
    (CHAT, {**CHAT_BASE, "salience": {"readouts": {"over": "everything"}}}, "salience.readouts.over"),
    (CHAT, {**CHAT_BASE, "salience": {"readouts": {"ranges": [[0, 1]]}}}, "salience.readouts"),
    (CHAT, {**CHAT_BASE, "salience": {"features": {"over": "all"}}}, "salience.features"),
    (CHAT, {**CHAT_BASE, "salience": {"features": {"k": 0}}}, "salience.features.k"),
    (CHAT, {**CHAT_BASE, "salience": {"features": {"k": 2, "sae": 4}}}, "salience.features.sae"),
    (CHAT, {**CHAT_BASE, "salience": {"monitors": {}}}, "salience.monitors"),
    (
        CHAT,
        {**CHAT_BASE, "salience": {"monitors": [{"concept": "c", "above": 2, "action": "stop"}]}},
        "salience.monitors",
    ),
    (
        CHAT,
        {**CHAT_BASE, "salience": {"monitors": [{"concept": "c", "above": 0.5, "action": "flag"}] * 17}},
        "salience.monitors",
    ),
    (CHAT, {**CHAT_BASE, "salience": {"steer": [{"direction": "d", "op": "spin"}]}}, "salience.steer[0]"),
    (CHAT, {**CHAT_BASE, "salience": {"steer": "d"}}, "salience.steer"),
    (CHAT, {**CHAT_BASE, "salience": {"patch": [{"point": "nowhere", "layer": 1}]}}, "salience.patch[0].point"),
    (CHAT, {**CHAT_BASE, "salience": {"patch": {"layer": 1}}}, "salience.patch"),
    (CHAT, {**CHAT_BASE, "salience": {"logprobs": "sampled"}}, "salience.logprobs"),
    (COMPLETION, {"prompt": "hi"}, "model"),
    (COMPLETION, {"model": "m"}, "prompt"),
    (COMPLETION, {**COMPLETION_BASE, "prompt": []}, "prompt"),
    (COMPLETION, {**COMPLETION_BASE, "prompt": [1, "a"]}, "prompt"),
    (COMPLETION, {**COMPLETION_BASE, "prompt": [[1], []]}, "prompt[1]"),
    (COMPLETION, {**COMPLETION_BASE, "prompt": [-1]}, "prompt"),
    (COMPLETION, {**COMPLETION_BASE, "logprobs": 6}, "logprobs"),
    (COMPLETION, {**COMPLETION_BASE, "logprobs": True}, "logprobs"),
    (COMPLETION, {**COMPLETION_BASE, "echo": True}, "echo"),
    (COMPLETION, {**COMPLETION_BASE, "suffix": "x"}, "suffix"),
    (COMPLETION, {**COMPLETION_BASE, "best_of": 3}, "best_of"),
    (COMPLETION, {**COMPLETION_BASE, "messages": []}, "messages"),
    (COMPLETION, {**COMPLETION_BASE, "max_completion_tokens": 5}, "max_completion_tokens"),
    (COMPLETION, {**COMPLETION_BASE, "response_format": {"type": "json"}}, "response_format.type"),
    (COMPLETION, {**COMPLETION_BASE, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (COMPLETION, {**COMPLETION_BASE, "min_p": -0.1}, "min_p"),
]

PARSE = {CHAT: parse_chat, COMPLETION: parse_completion}


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD, ids=[f"{e}:{p}" for e, _, p in BAD])
def test_a_bad_request_is_a_400_naming_its_param(endpoint: str, body: dict, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        PARSE[endpoint](orjson.dumps(body))
    error = caught.value
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param), error.message
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


def test_an_unknown_field_is_refused_as_openai_refuses_it() -> None:
    with pytest.raises(ApiError, match="Unrecognized request argument supplied: frobnicate"):
        parse_chat(orjson.dumps({**CHAT_BASE, "frobnicate": 1}))


@pytest.mark.parametrize("body", [b"", b"{", b"[1]", b'"text"'])
def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat(body)
    assert (caught.value.status, caught.value.param) == (400, None)


def test_a_chat_request_reads_every_field() -> None:
    body = {
        **CHAT_BASE,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_tokens": 7,
        "max_completion_tokens": 9,  # wins: max_tokens is its deprecated spelling
        "temperature": 0,
        "top_p": 0.5,
        "seed": 4,
        "stop": "\n",
        "n": 2,
        "logit_bias": {"17": -100, "3": 2.5},
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logprobs": True,
        "top_logprobs": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "u-1",  # accepted, no effect
        "metadata": {"k": "v"},
        "tools": [],  # neutral
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "frequency": None,  # null means absent, even for a name this server does not know
    }
    request = parse_chat(orjson.dumps(body))
    assert request.kind == CHAT and request.model == "m"
    assert request.messages == (ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="hi"))
    assert request.sampling == Sampling(
        max_tokens=9,
        temperature=0.0,
        top_p=0.5,
        seed=4,
        stop=("\n",),
        n=2,
        logit_bias={17: -100.0, 3: 2.5},
        presence_penalty=0.5,
        frequency_penalty=-0.5,
    )
    assert (request.logprobs, request.top_logprobs, request.stream, request.include_usage) == (True, 3, True, True)
    assert request.salience is None


def test_vllms_extras_are_read_as_vllm_spells_them() -> None:
    extras = {
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "min_tokens": 3,
        "ignore_eos": True,
        "stop_token_ids": [7, 9],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "structured_outputs": {"choice": ["yes", "no"], "regex": None, "disable_any_whitespace": False},
    }
    for parse, base in ((parse_chat, CHAT_BASE), (parse_completion, COMPLETION_BASE)):
        sampling = parse(orjson.dumps({**base, **extras})).sampling
        assert (sampling.top_k, sampling.min_p, sampling.repetition_penalty, sampling.min_tokens) == (40, 0.05, 1.2, 3)
        assert (sampling.ignore_eos, sampling.stop_token_ids) == (True, (7, 9))
        assert (sampling.include_stop_str_in_output, sampling.skip_special_tokens) == (True, False)
        assert sampling.structured_outputs == Constraint(
            kind="choice", spec=("yes", "no"), source="structured_outputs.choice"
        )
    assert parse_chat(orjson.dumps({**CHAT_BASE, "top_k": -1})).sampling.top_k == 0  # vLLM's "off"


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(
    ("response_format", "want"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, Constraint(kind="json_object", spec=None, source="response_format")),
        (
            {"type": "json_schema", "json_schema": {"name": "City", "schema": SCHEMA, "strict": True}},
            Constraint(
                kind="json",
                spec='{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}',
                source="response_format.json_schema.schema",
            ),
        ),
        (  # a schema as JSON text reads as the same schema
            {"type": "json_schema", "json_schema": {"name": "City", "schema": orjson.dumps(SCHEMA).decode()}},
            Constraint(
                kind="json",
                spec='{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}',
                source="response_format.json_schema.schema",
            ),
        ),
    ],
)
def test_response_format_is_one_core_constraint(response_format: dict, want: Constraint | None) -> None:
    for parse, base in ((parse_chat, CHAT_BASE), (parse_completion, COMPLETION_BASE)):
        assert parse(orjson.dumps({**base, "response_format": response_format})).sampling.structured_outputs == want
    # text beside structured_outputs is no second constraint
    both = {**CHAT_BASE, "response_format": {"type": "text"}, "structured_outputs": {"regex": "[a-z]+"}}
    assert parse_chat(orjson.dumps(both)).sampling.structured_outputs.kind == "regex"


def test_defaults_are_openais() -> None:
    chat = parse_chat(orjson.dumps(CHAT_BASE))
    assert chat.sampling == Sampling()  # chat: max_tokens None, up to the context
    assert (chat.logprobs, chat.top_logprobs, chat.stream, chat.include_usage) == (False, 0, False, False)
    completion = parse_completion(orjson.dumps(COMPLETION_BASE))
    assert completion.sampling.max_tokens == 16
    assert (completion.logprobs, completion.top_logprobs) == (False, 0)
    assert parse_completion(orjson.dumps({**COMPLETION_BASE, "logprobs": 0})).logprobs  # the token's own only


@pytest.mark.parametrize(
    ("prompt", "read"),
    [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1, 2], [3]], ((1, 2), (3,))),
    ],
)
def test_the_four_prompt_forms(prompt: object, read: tuple) -> None:
    assert parse_completion(orjson.dumps({**COMPLETION_BASE, "prompt": prompt})).prompts == read


def test_the_extension_reads_its_parts_with_the_cores_parsers() -> None:
    body = {
        **CHAT_BASE,
        "salience": {
            "readouts": {"format": "probability", "over": "all"},
            "features": {"k": 4, "sae": "s"},
            "monitors": [{"concept": "code", "above": 0.9, "action": "stop"}],
            "steer": [{"direction": "french", "layers": 3, "value": 8}],
            "patch": [{"hook": "blocks.2.hook_mlp_out", "positions": [4], "rows": [1.0, 2.0]}],
        },
    }
    extension = parse_chat(orjson.dumps(body)).salience
    assert extension == Extension(
        readouts=Readouts(format="probability", over="all"),
        features=Features(k=4, sae="s", over="completion"),
        monitors=(Monitor(concept="code", above=0.9, action=Action.STOP),),
        steer=(Intervention(direction="french", layers=(3,), op=Op.ADD, value=8, generated=True),),
        patch=(Patch(point="mlp_out", layer=2, positions=(4,), rows=np.array([1, 2], "<f4").tobytes()),),
    )
    assert extension.probes().patch == extension.patch
    assert parse_extension({}) == Extension()
    assert parse_extension({"readouts": {}}).readouts == Readouts(format="raw", over="completion")


@pytest.mark.parametrize(
    ("extension", "readout_ranges", "feature_ranges", "per_token"),
    [
        (Extension(readouts=Readouts(over="prompt")), ((0, 10),), None, False),
        (Extension(readouts=Readouts(over="completion")), ((10, 15),), None, True),
        (Extension(readouts=Readouts(over="all")), ((0, 15),), None, True),
        (Extension(features=Features(k=2, over="prompt")), (), ((0, 10),), False),
        (Extension(features=Features(k=2)), (), ((10, 15),), True),
        (Extension(monitors=(Monitor(concept="c", above=0.5, action=Action.FLAG),)), (), None, True),
        (Extension(), (), None, False),
    ],
)
def test_spans_become_the_engines_position_ranges(
    extension: Extension, readout_ranges: tuple, feature_ranges: tuple | None, per_token: bool
) -> None:
    probes = extension.probes(10, 5)
    assert probes.readout_ranges == readout_ranges
    assert (probes.features and probes.features.ranges) == feature_ranges
    assert extension.per_token == per_token


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (errors.InvalidArgument("x"), 400, "invalid_request_error", None),
        (errors.ContextOverflow("x"), 400, "invalid_request_error", "context_length_exceeded"),
        (errors.NotFound("x"), 404, "invalid_request_error", "not_found"),
        (errors.ResourceExhausted("x"), 429, "rate_limit_error", "rate_limit_exceeded"),
        (errors.PermissionDenied("x"), 403, "permission_error", None),
        (errors.Unavailable("x"), 503, "server_error", "unavailable"),
        (errors.EngineError("x"), 500, "server_error", None),
    ],
)
def test_salience_errors_map_to_the_statuses_the_openai_client_knows(
    error: errors.SalienceError, status: int, kind: str, code: str | None
) -> None:
    mapped = from_salience(error)
    assert (mapped.status, mapped.type, mapped.code, mapped.kind) == (status, kind, code, type(error).__name__)


def test_naming_finds_the_param_of_the_errors_field() -> None:
    def raised(message: str, field: str | None = None, **kwargs) -> ApiError:
        with pytest.raises(ApiError) as caught, naming(**kwargs):
            raise errors.InvalidArgument(message, field=field)
        return caught.value

    assert raised("messages[2].role must be one of", "messages[2].role", param="messages").param == "messages[2].role"
    assert raised("the template refused", param="messages").param == "messages"
    assert raised(
        "steer[1]: unknown field", "steer[1]", param="salience.steer", fields={"steer": "salience"}
    ).param == ("salience.steer[1]")
    assert raised("top_p must be in (0, 1]", "top_p", param="salience", fields={"top_p": ""}).param == "top_p"
    assert raised("monitor 0: unknown concept", "monitors[0]", param="salience", fields={"top_p": ""}).param == (
        "salience"
    )
    assert raised("the server is draining").param is None
    missing = raised("model 'x' is not served here", param="model", status=404, code="model_not_found")
    assert (missing.status, missing.param, missing.code) == (404, "model", "model_not_found")


def test_401_is_an_openai_error_object() -> None:
    error = unauthorized()
    assert error.status == 401
    assert error.body()["error"]["code"] == "invalid_api_key"


# ---- responses ------------------------------------------------------------------------------

VOCAB = ["<s>", "</s>", "Hello", " world", "\n\n", "Bye", "!", " St", "OP", " there", "é"]
EOS = 1


class Tokenizer:
    """A vocabulary of whole strings: what TextStream and TokenText read of a tokenizer."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(VOCAB[i] for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return VOCAB[token_id].replace(" ", "▁")


def events(ids: list[int], finish: FinishReason, start: int = 3) -> list[TokenEvent]:
    out = [
        TokenEvent(
            token_id=t, position=start + i, logprob=-0.5 * i, top_logprobs=((t, -0.1), (9, -2.0), (6, -math.inf))
        )
        for i, t in enumerate(ids)
    ]
    out[-1] = TokenEvent(
        token_id=ids[-1],
        position=start + len(ids) - 1,
        logprob=-1.0,
        top_logprobs=((ids[-1], -1.0),),
        finish_reason=finish,
    )
    return out


def run(ids: list[int], finish: FinishReason, stop: tuple[str, ...] = (), readings: Readings | None = None):
    choice = Choice(0, Tokenizer(), [0, 2, 3], stop, readings)
    steps = []
    for event in events(ids, finish):
        steps.append(choice.push(event))
        if steps[-1].finish is not None:
            break
    return choice, steps


def test_the_stop_token_adds_no_text() -> None:
    choice, steps = run([2, 3, EOS], FinishReason.STOP)
    assert [s.text for s in steps] == ["Hello", " world", ""]
    assert (choice.finish, choice.tokens) == ("stop", 3)


def test_a_stop_string_across_tokens_never_reaches_the_client_in_part() -> None:
    choice, steps = run([2, 7, 8, 9, 5], FinishReason.LENGTH, stop=("StOP",))
    # 3 characters (len("StOP") - 1) are held back: "St" never goes out before "OP" says it stops.
    assert [s.text for s in steps] == ["He", "llo", " "]
    assert (choice.finish, choice.tokens, steps[-1].finish) == ("stop", 3, "stop")
    assert all(s.event is not None for s in steps)  # every token reported, the stopping one too


def test_the_earliest_stop_string_wins_and_the_rest_is_released_at_the_end() -> None:
    _, steps = run([2, 4, 5, 6], FinishReason.LENGTH, stop=("!", "\n\n"))
    assert "".join(s.text for s in steps) == "Hello"
    _, steps = run([2, 3, 5], FinishReason.LENGTH, stop=("nothing here",))
    assert "".join(s.text for s in steps) == "Hello worldBye" and steps[-1].finish == "length"


def texts(ids: list[int], finish: FinishReason, stop: tuple[str, ...] = (), **rules) -> list[str]:
    choice = Choice(0, Tokenizer(), [0, 2, 3], stop, **rules)
    steps = [choice.push(event) for event in events(ids, finish)]
    return [step.text for step in steps[: next(i for i, s in enumerate(steps) if s.finish) + 1]]


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text() -> None:
    assert texts([2, 7, 8, 9, 5], FinishReason.LENGTH, ("StOP",), include_stop=True) == ["He", "llo", " StOP"]
    assert texts([2, 6], FinishReason.STOP, include_stop=True) == ["Hello", "!"]  # "!" a stop_token_id
    assert texts([2, 6], FinishReason.STOP) == ["Hello", ""]


def test_min_tokens_leaves_the_first_tokens_text_unsearched_as_vllm_does() -> None:
    assert texts([2, 3, 5], FinishReason.LENGTH, ("Hello",)) == [""]
    assert "".join(texts([2, 3, 5], FinishReason.LENGTH, ("Hello",), min_tokens=1)) == "Hello worldBye"
    # a stop string that starts in the unsearched text and ends after it is found
    assert texts([2, 7, 8], FinishReason.LENGTH, ("lo St",), min_tokens=1) == ["H", "el"]


def test_a_choice_cancelled_by_the_server_is_an_error_for_the_client() -> None:
    choice = Choice(0, Tokenizer(), [0])
    with pytest.raises(errors.Unavailable):
        choice.end(FinishReason.CANCELLED)
    assert choice.end(FinishReason.LENGTH).finish == "length"


def test_token_text_keeps_each_tokens_bytes_and_sentencepiece_spaces() -> None:
    pieces = TokenText(Tokenizer())
    assert (pieces.text(3), pieces.bytes(3)) == (" world", b" world")
    assert pieces.bytes(10) == "é".encode()


def sse_events(data: bytes) -> list[str]:
    """The events as the `openai` package's own decoder reads them."""
    return [event.data for event in SSEDecoder().iter_bytes(iter([data[i : i + 7] for i in range(0, len(data), 7)]))]


def test_chat_chunks_parse_as_the_sdks_chunks() -> None:
    pieces = TokenText(Tokenizer())
    chunks = Chunks(CHAT, "chatcmpl-r1", 1700000000, "m", Logprobs(CHAT, pieces, 2))
    _, steps = run([2, 3, EOS], FinishReason.STOP)
    data = chunks.role(0) + b"".join(chunks.step(0, s) for s in steps) + chunks.usage(usage(3, 3, 1)) + DONE
    assert data.count(b"\n\n") == 6 and all(line.startswith(b"data: ") for line in data.split(b"\n\n")[:-1])
    sent = sse_events(data)
    assert sent[-1] == "[DONE]"
    parsed = [ChatCompletionChunk.model_validate_json(event) for event in sent[:-1]]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parsed[1:-1]) == "Hello world"
    assert [c.choices[0].finish_reason for c in parsed[1:-1]] == [None, None, "stop"]
    first = parsed[1].choices[0].logprobs.content[0]
    assert (first.token, first.bytes, first.logprob) == ("Hello", list(b"Hello"), 0.0)
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("Hello", -0.1), (" there", -2.0)]  # no -inf
    assert parsed[-1].choices == [] and parsed[-1].usage.prompt_tokens_details.cached_tokens == 1
    assert all(c.id == "chatcmpl-r1" and c.model == "m" for c in parsed)
    assert not any("salience" in orjson.loads(event) for event in sent[:-1])  # a plain request: no extension


def test_a_chat_response_parses_as_the_sdks_chat_completion() -> None:
    pieces = TokenText(Tokenizer())
    collected = [Collected(1), Collected(0)]
    for collect in collected:
        for step in run([2, 3, EOS], FinishReason.STOP)[1]:
            collect.add(step)
    body = response(CHAT, "chatcmpl-r2", 1, "m", collected, usage(3, 6, 0), Logprobs(CHAT, pieces, 0), None)
    parsed = ChatCompletion.model_validate_json(body)
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.choices[0].message.content == "Hello world" and parsed.choices[0].finish_reason == "stop"
    assert [t.token for t in parsed.choices[0].logprobs.content] == ["Hello", " world", "</s>"]
    assert parsed.choices[0].logprobs.content[0].top_logprobs == []
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (3, 6, 9)
    assert "salience" not in orjson.loads(body)


def test_completions_parse_as_the_sdks_completion() -> None:
    pieces = TokenText(Tokenizer())
    logprobs = Logprobs(COMPLETION, pieces, 1)
    chunks = Chunks(COMPLETION, "cmpl-r3", 1, "m", logprobs)
    _, steps = run([2, 3, 5], FinishReason.LENGTH)
    sent = sse_events(b"".join(chunks.step(0, s) for s in steps) + DONE)
    # The SDK types a choice's finish_reason as never null, though OpenAI's own streams send
    # null before the last chunk (its client builds chunks without validating them).
    parsed = []
    for event in sent[:-1]:
        data = orjson.loads(event)
        data["choices"] = [{**c, "finish_reason": c["finish_reason"] or "length"} for c in data["choices"]]
        parsed.append(Completion.model_validate(data))
    assert "".join(c.choices[0].text for c in parsed) == "Hello worldBye"
    assert [c.choices[0].logprobs.text_offset for c in parsed] == [[0], [5], [11]]
    assert parsed[1].choices[0].logprobs.top_logprobs == [{" world": -0.1}]
    collect = Collected(0)
    for step in steps:
        collect.add(step)
    whole = Completion.model_validate_json(
        response(COMPLETION, "cmpl-r3", 1, "m", [collect], usage(3, 3, 0), logprobs, None)
    )
    assert whole.choices[0].text == "Hello worldBye" and whole.choices[0].logprobs.tokens == ["Hello", " world", "Bye"]
    assert whole.choices[0].logprobs.text_offset == [0, 5, 11]


def test_an_error_mid_stream_is_raised_by_the_sdk() -> None:
    chunks = Chunks(CHAT, "chatcmpl-r4", 1, "m", None)
    event = sse_events(chunks.error(from_salience(errors.Unavailable("the server is shutting down"))))[0]
    assert orjson.loads(event)["error"]["type"] == "server_error"
    assert issubclass(openai.InternalServerError, openai.APIStatusError)  # what 503 becomes before a stream


# ---- the extension's response side -----------------------------------------------------------

CALIBRATED = {
    "layers": [
        {"layer": 1, "scale": 1.0, "offset": 0.0, "running_scale": 1.0, "running_offset": 0.0},
        {"layer": 2, "scale": 2.0, "offset": 0.0, "running_scale": 3.0, "running_offset": -0.5},
    ]
}
VIEW = ConceptView(
    version=1,
    concepts=("code", "raw"),
    columns=(0, 1),
    layers=(1, 2),
    hidden_size=8,
    info=({**CALIBRATED, "recommended_layer": 2}, None),
)


def logistic(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_readings_summarize_each_calibrated_concept_at_its_recommended_layer() -> None:
    extension = Extension(readouts=Readouts(format="raw", over="all"))
    readings = Readings(extension, VIEW, TokenText(Tokenizer()))
    rows = [(0.0, 9.0, 0.5, 9.0), (0.0, 9.0, 1.5, 9.0), (0.0, 9.0, -1.0, 9.0)]  # layer-major: [L1 code, raw, L2 ...]
    choice = Choice(0, Tokenizer(), [0, 2, 3], (), readings)
    steps = [
        choice.push(TokenEvent(token_id=t, position=3 + i, logprob=0.0, top_logprobs=(), readout=row, finish_reason=f))
        for i, (t, row, f) in enumerate(zip([2, 3, 5], rows, [None, None, FinishReason.LENGTH], strict=True))
    ]
    assert [s.entry for s in steps] == [{"position": 3 + i, "readout": row} for i, row in enumerate(rows)]
    summary = steps[-1].end["summary"]
    assert list(summary) == ["code"]  # "raw" has no calibration
    code = summary["code"]
    probabilities = [logistic(2 * row[2]) for row in rows]
    assert code["layer"] == 2 and code["mean"] == pytest.approx(sum(probabilities) / 3)
    assert code["max"] == pytest.approx(max(probabilities))
    assert code["max_at"] == {"index": 1, "position": 4, "token": " world"}
    # The completion's running p: the running map of its raw values' mean (0.5 + 1.5 - 1.0) / 3.
    assert code["running"] == pytest.approx(logistic(3 * (1.0 / 3) - 0.5), abs=1e-12)
    assert layout(extension, VIEW) == {"concepts": ["code", "raw"], "layers": [1, 2], "format": "raw"}
    prompt = readings.prompt([0, 2, 3], {1: (0.1, 0.2, 0.3, 0.4)}, {"features": {2: ((7, 1.5),)}})
    assert prompt == [
        {"position": 1, "token_id": 2, "token": "Hello", "readout": (0.1, 0.2, 0.3, 0.4)},
        {"position": 2, "token_id": 3, "token": " world", "features": [[7, 1.5]]},
    ]


def test_a_json_reply_gets_the_summarys_figures_per_leaf_over_the_leafs_tokens() -> None:
    readings = Readings(Extension(readouts=Readouts(format="raw")), VIEW, TokenText(Tokenizer()), fields=True)
    texts = ['{"a":', ' "x', 'y"', ', "b": [true', "]}", ""]  # $.a is tokens 1-2, $.b[0] token 3
    raws = [0.5, 1.5, -1.0, 2.0, 0.0, None]  # the last token has no readout (the context is full)
    for i, (text, raw) in enumerate(zip(texts, raws, strict=True)):
        row = None if raw is None else (0.0, 9.0, raw, 9.0)
        readings.token(TokenEvent(token_id=2 + i, position=3 + i, logprob=0.0, top_logprobs=(), readout=row), i, text)
    end = readings.end()
    a, b = end["fields"]
    assert (a["path"], a["tokens"], a["chars"]) == ("$.a", {"first": 1, "last": 2}, {"start": 7, "end": 9})
    assert (b["path"], b["tokens"]) == ("$.b[0]", {"first": 3, "last": 3})
    code = a["concepts"]["code"]
    assert code["running"] == pytest.approx(logistic(3 * (0.5 + 1.5 - 1.0) / 3 - 0.5))  # at its last token
    assert code["mean"] == pytest.approx((logistic(3.0) + logistic(-2.0)) / 2)
    assert (code["max"], code["max_at"]) == (
        pytest.approx(logistic(3.0)),
        {"index": 1, "position": 4, "token": " world"},
    )
    assert b["concepts"]["code"]["running"] == pytest.approx(logistic(3 * 3.0 / 4 - 0.5))
    assert b["concepts"]["code"]["max_at"]["index"] == 3
    assert end["summary"]["code"]["running"] == pytest.approx(logistic(3 * 3.0 / 5 - 0.5))  # the reply's 5 read
    plain = Readings(Extension(readouts=Readouts(format="raw")), VIEW, TokenText(Tokenizer()))
    plain.token(TokenEvent(token_id=2, position=3, logprob=0.0, top_logprobs=(), readout=(0, 9, 1, 9)), 0, "{}")
    assert set(plain.end()) == {"summary"}  # no constraint to JSON: no fields


def test_a_stop_monitor_ends_the_choice_as_content_filter_and_names_concept_and_token() -> None:
    monitor = Monitor(concept="code", above=0.9, action=Action.STOP)
    readings = Readings(Extension(monitors=(monitor,)), VIEW, TokenText(Tokenizer()))
    fired = MonitorEvent(monitor=0, concept="code", layer=2, position=4, probability=0.95, action=Action.STOP)
    choice = Choice(0, Tokenizer(), [0, 2, 3], (), readings)
    choice.push(TokenEvent(token_id=2, position=3, logprob=0.0, top_logprobs=()))
    last = choice.push(
        TokenEvent(
            token_id=3, position=4, logprob=0.0, top_logprobs=(), monitors=(fired,), finish_reason=FinishReason.MONITOR
        )
    )
    assert last.text == " world" and last.finish == "content_filter"
    assert last.entry["monitors"] == [fired.as_dict()]
    assert last.end == {"stopped_by": {**fired.as_dict(), "index": 1, "token": " world"}}
    chunks = Chunks(CHAT, "chatcmpl-r5", 1, "m", None)
    chunk = ChatCompletionChunk.model_validate_json(sse_events(chunks.step(0, last))[0])
    assert chunk.choices[0].finish_reason == "content_filter"
    assert chunk.choices[0].model_extra["salience"]["stopped_by"]["concept"] == "code"


def test_the_layout_goes_on_the_streams_first_chunk_and_the_prompt_on_the_choices_first_token() -> None:
    extension = Extension(readouts=Readouts(format="probability", over="all"))
    readings = Readings(extension, VIEW, TokenText(Tokenizer()))
    chunks = Chunks(CHAT, "chatcmpl-r6", 1, "m", None)
    chunks.layout = layout(extension, VIEW)
    choice = Choice(0, Tokenizer(), [0, 2, 3], (), readings)
    step = choice.push(TokenEvent(token_id=2, position=3, logprob=0.0, top_logprobs=(), readout=(0.1, None, 0.7, None)))
    step.prompt = readings.prompt([0, 2, 3], {0: (0.2, None, 0.3, None)}, {})
    sent = [orjson.loads(e) for e in sse_events(chunks.role(0) + chunks.step(0, step))]
    assert sent[0]["salience"] == {"concepts": ["code", "raw"], "layers": [1, 2], "format": "probability"}
    assert "salience" not in sent[1]
    assert sent[1]["choices"][0]["salience"] == {
        "prompt": [{"position": 0, "token_id": 0, "token": "<s>", "readout": [0.2, None, 0.3, None]}],
        "tokens": [{"position": 3, "readout": [0.1, None, 0.7, None]}],
    }
    for event in sent:
        ChatCompletionChunk.model_validate(event)


def test_byte_level_tokens_keep_the_bytes_of_a_split_character(default_model) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    pieces = TokenText(tokenizer)
    ids = tokenizer.encode("héllo 😀 code")
    assert b"".join(pieces.bytes(i) for i in ids).decode() == "héllo 😀 code"
    assert "\ufffd" in "".join(pieces.text(i) for i in ids)  # the emoji spans two tokens
    assert pieces.text(ids[-1]) == " code"


def test_what_langchain_sends_is_accepted() -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI, OpenAI

    where = {"model": "m", "base_url": "http://127.0.0.1:1/v1", "api_key": "x"}
    conversation = [SystemMessage("be brief"), HumanMessage("hi"), AIMessage("hello"), HumanMessage("again")]
    chat = ChatOpenAI(**where, temperature=0, max_tokens=5, stop=["\n"], logprobs=True, top_logprobs=2)
    payload = chat._get_request_payload(conversation, stream=True, stream_options={"include_usage": True})
    request = parse_chat(orjson.dumps(payload))
    assert [m.role for m in request.messages] == ["system", "user", "assistant", "user"]
    assert (request.sampling.max_tokens, request.sampling.stop, request.top_logprobs) == (5, ("\n",), 2)
    assert request.stream and request.include_usage
    legacy = OpenAI(**where)
    request = parse_completion(orjson.dumps({**legacy._invocation_params, "prompt": ["hi"]}))
    assert (request.sampling.max_tokens, request.sampling.temperature) == (256, 0.7)
