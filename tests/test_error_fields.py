"""Errors name the request field at fault (`exc.field`), the path their message starts with, and
the gRPC frontend carries it as a BadRequest field violation. No engine."""

from __future__ import annotations

import grpc
import pytest

from salience import request_ids
from salience.core.engine.chat_messages import check_tool_replies, parse_messages
from salience.core.engine.checks import RequestChecks
from salience.core.engine.constraints import parse_constraint
from salience.core.engine.fair_share import check_client
from salience.core.engine.requests import ResidualRequest
from salience.core.engine.rows import residual_plan
from salience.core.probes.monitors import parse_monitors
from salience.core.probes.steering_json import parse_interventions
from salience.errors import InvalidArgument, join, under
from salience.grpc_frontend.client import field_of
from salience.grpc_frontend.error_fields import DETAILS
from salience.grpc_frontend.status_codes import details

ADD = {"direction": "french", "layers": [3], "value": 2}

CASES = [
    (lambda: parse_interventions({"direction": "x"}), "steer"),
    (lambda: parse_interventions([ADD, {**ADD, "value": "big"}]), "steer[1]"),
    (lambda: parse_interventions([{**ADD, "vector": "not base64!"}]), "steer[0]"),
    (lambda: parse_interventions([{**ADD, "positions": [[0, 1], [2]]}]), "steer[0]"),
    (lambda: parse_monitors({}), "monitors"),
    (lambda: parse_monitors([{"concept": "x", "above": 2, "action": "flag"}]), "monitors[0].above"),
    (lambda: parse_monitors([{"concept": "x", "above": 0.5, "action": "flag"}, "m"]), "monitors[1]"),
    (
        lambda: parse_messages([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]),
        "messages[1].role",
    ),
    (
        lambda: parse_messages(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
        ),
        "messages[0].content[0].image_url.url",
    ),
    (lambda: check_tool_replies(parse_messages([{"role": "tool", "content": "x"}])), "messages[0].tool_call_id"),
    (lambda: parse_constraint({"regex": "a", "choice": ["b"]}), "structured_outputs"),
    (lambda: parse_constraint({"json": "{oops"}, "constraint"), "constraint.json"),
    (lambda: parse_constraint({"json": {}, "backend": "x"}), "structured_outputs.backend"),
    (lambda: request_ids.check("a b"), "request_id"),
    (lambda: request_ids.check("", "x-request-id metadata"), "x-request-id metadata"),
    (lambda: RequestChecks(vocab_size=10, max_model_len=64, max_logprobs=5).tokens("prompt", [1, 2, 10]), "prompt[2]"),
    (lambda: check_client("alice", 0), "weight"),
    (
        lambda: residual_plan(
            ResidualRequest(layers=(3,), ranges=((2, 1),)), 9, read=(3,), slots=(0,), hidden=4, limit=99
        ),
        "residual.ranges[0]",
    ),
]


@pytest.mark.parametrize(("call", "field"), CASES)
def test_the_error_names_its_field(call, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        call()
    assert caught.value.field == field


def test_under_prefixes_the_field_a_part_names() -> None:
    with pytest.raises(InvalidArgument) as caught, under("salience"):
        parse_interventions([{**ADD, "op": "twist"}])
    assert caught.value.field == "salience.steer[0]"


def test_the_grpc_trailer_carries_the_field() -> None:
    code, message = grpc.StatusCode.INVALID_ARGUMENT, "steer[0]: value must be a number (request_id=r1)"
    trailers = grpc.aio.Metadata(
        ("x-request-id", "r1"), (DETAILS, details(code, message, "interventions[0]", "steer[0]: value ..."))
    )
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, message)
    assert field_of(error) == "interventions[0]"
    plain = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(("x-request-id", "r1")), message)
    assert field_of(plain) is None


def test_under_renames_only_a_fields_first_name() -> None:
    names = {"steer": "interventions", "max_tokens": "generate.max_tokens"}
    for field, wire in [
        ("steer[2].value", "turn.interventions[2].value"),
        ("max_tokens", "turn.generate.max_tokens"),
        ("monitors[0].steer", "turn.monitors[0].steer"),
        (None, "turn"),
    ]:
        with pytest.raises(InvalidArgument) as caught, under("turn", names):
            raise InvalidArgument("bad", field=field)
        assert caught.value.field == wire
    assert join("", None) is None
    assert join("messages", "[1].role") == "messages[1].role"
