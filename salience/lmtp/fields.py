"""LMTP's client messages field by field: each message type's readers and required fields.

Every reader takes the JSON value and the field's name and returns the typed value, or raises
InvalidArgument whose `field` is the one at fault (codec.py puts the message type in front of
its message). The small readers are salience.readers', the OpenAI API's too.
Validation here is about shape; what depends on the model is the core engine's check.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from salience import readers, request_ids
from salience.core.engine.chat_messages import ChatMessage, parse_messages
from salience.core.engine.constraints import parse_constraint
from salience.core.engine.requests import Constraint, FeatureRequest, ImageBlock, ResidualRequest
from salience.core.models.points import POINTS
from salience.core.probes.calibration import VIEW_NAMES
from salience.core.probes.monitors import Monitor, parse_monitors
from salience.core.probes.patching import Patch, parse_patches
from salience.core.probes.steering import Intervention
from salience.core.probes.steering_json import parse_interventions, parse_vector
from salience.core.serving.patch_sweep import METRICS
from salience.errors import InvalidArgument
from salience.lmtp.messages import (
    Cancel,
    CloseSession,
    DefineConcept,
    DeleteConcept,
    Detokenize,
    DumpSession,
    ForkSession,
    Generate,
    ImageInfo,
    ModelInfo,
    OpenSession,
    PatchSweep,
    SaveConcepts,
    Score,
    SessionGenerate,
    Status,
    Tokenize,
)

__all__ = ["ALTERNATIVES", "INT_LIMIT", "READOUT_ENCODINGS", "READOUT_FORMATS", "TYPES", "valid_request_id"]

INT_LIMIT = readers.INT64


# ---- field readers: each raises InvalidArgument whose field is the one read ----------------

_int, _number, _bool, _str, _show = readers.integer, readers.number, readers.boolean, readers.string, readers.show


def valid_request_id(value: Any) -> str | None:
    """A line's request_id if it is valid, so an error about the line's other fields can name it."""
    try:
        return request_ids.check(value)
    except InvalidArgument:
        return None


def _tokens(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a list of token ids, got {_show(value)}", field=name)
    for i, token in enumerate(value):
        if type(token) is not int or token < 0 or token >= INT_LIMIT:
            raise InvalidArgument(
                f"{name}[{i}] must be a non-negative integer token id, got {_show(token)}", field=f"{name}[{i}]"
            )
    return tuple(value)


def _messages(value: Any, name: str) -> tuple[ChatMessage, ...]:
    """OpenAI's chat messages, their shape checked; the model's chat template renders them (streams.py)."""
    return parse_messages(value, name)


def _bias(value: Any, name: str) -> Mapping[int, float]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{name} must be an object of token id -> bias, got {_show(value)}", field=name)
    bias = {}
    for key, amount in value.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidArgument(f"{name} key {key!r} is not a non-negative token id", field=name)
        bias[int(key)] = _number(amount, f"{name}[{key}]")
    return MappingProxyType(bias)


def _ranges(value: Any, name: str) -> tuple[tuple[int, int], ...]:
    """The shape only: `0 <= start < end` is core's rule (readouts.check_ranges), for every wire."""
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a list of [start, end] position ranges, got {_show(value)}", field=name)
    ranges = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            raise InvalidArgument(
                f"{name}[{i}] must be [start, end] with integer positions, got {_show(pair)}", field=f"{name}[{i}]"
            )
        ranges.append((pair[0], pair[1]))
    return tuple(ranges)


def _base64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a base64 string, got {_show(value)}", field=name)
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise InvalidArgument(f"{name} is not valid base64", field=name) from None


def _images(value: Any, name: str) -> tuple[ImageBlock, ...]:
    if not isinstance(value, list):
        raise InvalidArgument(f"{name} must be a list of images, got {_show(value)}", field=name)
    images = []
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict) or set(item) != {"data", "mime", "start", "end"}:
            raise InvalidArgument(
                f'{where} must be {{"data": base64, "mime", "start", "end"}}, got {_show(item)}', field=where
            )
        images.append(
            ImageBlock(
                start=_int(item["start"], f"{where}.start", 0),
                end=_int(item["end"], f"{where}.end", 0),
                data=_base64(item["data"], f"{where}.data"),
                mime=_str(item["mime"], f"{where}.mime"),
            )
        )
    return tuple(images)


def _steer(value: Any, name: str) -> tuple[Intervention, ...]:
    """The shape of each intervention; names, layers and values are the engine's to check."""
    return parse_interventions(value)


def _patch(value: Any, name: str) -> tuple[Patch, ...]:
    """The shape of each patch; sites, positions and rows are the engine's to check."""
    return parse_patches(value)


def _monitors(value: Any, name: str) -> tuple[Monitor, ...]:
    """The shape of each monitor; concepts and layers are the engine's to check."""
    return parse_monitors(value)


def _constraint(value: Any, name: str) -> Constraint:
    """vLLM's structured_outputs object, read by core's reader (the OpenAI API's too); whether the
    backend compiles it is the engine's check."""
    return parse_constraint(value, name)


def _one_of(choices: tuple[str, ...]) -> _Reader:
    def read(value: Any, name: str) -> str:
        if value not in choices:
            raise InvalidArgument(
                f"{name} must be one of {', '.join(map(repr, choices))}, got {_show(value)}", field=name
            )
        return value

    return read


def _residual(value: Any, name: str) -> ResidualRequest:
    """{"layers": [...], "ranges": [[start, end], ...], "point"?: P}; the engine checks them against
    the model."""
    if not isinstance(value, dict) or set(value) - {"layers", "ranges", "point"} or "layers" not in value:
        raise InvalidArgument(
            f'{name} must be {{"layers": [...], "ranges": [[start, end], ...], "point"?: POINT}}', field=name
        )
    layers = value["layers"]
    if not isinstance(layers, list) or not all(type(x) is int for x in layers):
        raise InvalidArgument(f"{name}.layers must be a list of layer indices", field=f"{name}.layers")
    point = value.get("point")
    if point is not None and point not in POINTS:
        raise InvalidArgument(
            f"{name}.point must be one of {', '.join(POINTS)}, got {_show(point)}", field=f"{name}.point"
        )
    return ResidualRequest(layers=tuple(layers), ranges=_ranges(value.get("ranges", []), f"{name}.ranges"), point=point)


def _features(value: Any, name: str) -> FeatureRequest:
    """{"k": K, "ranges": [[start, end], ...], "sae"?: NAME}; the engine checks them against the SAEs."""
    if not isinstance(value, dict) or set(value) - {"sae", "k", "ranges"} or "k" not in value:
        raise InvalidArgument(f'{name} must be {{"k": K, "ranges": [[start, end], ...], "sae"?: NAME}}', field=name)
    sae = value.get("sae")
    if sae is not None and not isinstance(sae, str):
        raise InvalidArgument(f"{name}.sae must name an SAE", field=f"{name}.sae")
    return FeatureRequest(  # k's range is the SAE's: the engine's check
        sae=sae, k=_int(value["k"], f"{name}.k"), ranges=_ranges(value.get("ranges", []), f"{name}.ranges")
    )


_Reader = Callable[[Any, str], Any]
READOUT_FORMATS = VIEW_NAMES
READOUT_ENCODINGS = ("json", "f32")  # a list of numbers, or base64 of little-endian float32
_GENERATE: dict[str, _Reader] = {
    "stream_id": _int,
    "prompt": _tokens,
    "messages": _messages,
    "model": _str,
    "max_tokens": lambda v, n: _int(v, n, 1),
    "temperature": _number,
    "top_p": _number,
    "top_k": lambda v, n: _int(v, n, -1),
    "seed": _int,
    "logit_bias": _bias,
    "top_logprobs": lambda v, n: _int(v, n, 0),
    "repetition_penalty": _number,
    "presence_penalty": _number,
    "frequency_penalty": _number,
    "length_penalty": _number,
    "stop_token_ids": _tokens,
    "priority": lambda v, n: _int(v, n, -(2**31), 2**31 - 1),
    "ignore_eos": _bool,
    "text": _bool,
    "readout": _ranges,
    "request_id": request_ids.check,
    "steer": _steer,
    "readout_format": _one_of(READOUT_FORMATS),
    "readout_encoding": _one_of(READOUT_ENCODINGS),
    "monitors": _monitors,
    "residual": _residual,
    "features": _features,
    "patch": _patch,
    "structured_outputs": _constraint,
}
_SCORE: dict[str, _Reader] = {
    "stream_id": _int,
    "prompt": _tokens,
    "messages": _messages,
    "scored": _tokens,
    "model": _str,
    "top_logprobs": lambda v, n: _int(v, n, 0),
    "text": _bool,
    "readout": _ranges,
    "request_id": request_ids.check,
    "steer": _steer,
    "readout_format": _GENERATE["readout_format"],
    "readout_encoding": _GENERATE["readout_encoding"],
    "residual": _residual,
    "features": _features,
    "patch": _patch,
}
_SESSION_GENERATE: dict[str, _Reader] = {
    "stream_id": _int,
    "session_id": _str,
    "offset": lambda v, n: _int(v, n, 0),
    "truncating": _bool,
    "append": _tokens,
    "max_tokens": lambda v, n: _int(v, n, 0),
    "logprobs": _ranges,
    "top_logprobs": lambda v, n: _int(v, n, 0),
    "readout": _ranges,
    **{
        name: _GENERATE[name]
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "stop_token_ids",
            "priority",
            "text",
            "request_id",
            "steer",
            "readout_format",
            "readout_encoding",
            "monitors",
            "residual",
            "features",
            "patch",
            "structured_outputs",
        )
    },
    "images": _images,
}


def _texts(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise InvalidArgument(f"{name} must be a list of texts", field=name)
    return tuple(value)


def _int_list(what: str) -> _Reader:
    def read(value: Any, name: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(type(x) is int for x in value):
            raise InvalidArgument(f"{name} must be a list of {what}", field=name)
        return tuple(value)

    return read


_layer_list = _int_list("layer indices")


def _vector(value: Any, name: str) -> bytes:
    return parse_vector(name, value)


def _vectors(value: Any, name: str) -> dict[int, bytes]:
    """{"<layer>": vector, ...}: JSON keys are strings."""
    if not isinstance(value, dict) or not value:
        raise InvalidArgument(f'{name} must be an object {{"<layer>": vector, ...}}', field=name)
    out = {}
    for key, vector in value.items():
        if not (key.isascii() and key.isdigit()):
            raise InvalidArgument(f"{name}: {key!r} is not a layer index", field=name)
        out[int(key)] = _vector(vector, f"{name}[{key}]")
    return out


_DEFINE_CONCEPT: dict[str, _Reader] = {
    "stream_id": _int,
    "name": _str,
    "positive": _texts,
    "negative": _texts,
    "method": _str,
    "layers": _layer_list,
    "vector": _vector,
    "vectors": _vectors,
}


def _points(value: Any, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or any(p not in POINTS for p in value):
        raise InvalidArgument(f"{name} must be a list of hook points ({', '.join(POINTS)})", field=name)
    return tuple(value)


_PATCH_SWEEP: dict[str, _Reader] = {
    "stream_id": _int,
    "clean": _tokens,
    "corrupted": _tokens,
    "answer": _tokens,
    "foil": _tokens,
    "points": _points,
    "layers": _layer_list,
    "positions": _int_list("positions"),
    "metric": _one_of(METRICS),
}
_SESSION_ID = {"stream_id": _int, "session_id": _str}
TYPES: dict[str, tuple[type, dict[str, _Reader], frozenset[str]]] = {
    "GENERATE": (Generate, _GENERATE, frozenset({"stream_id"})),
    "SCORE": (Score, _SCORE, frozenset({"stream_id", "scored"})),
    # LMQL sends {"stream_id", "model", "data": {"model": ...}}.
    "MODEL_INFO": (ModelInfo, {"stream_id": _int, "model": _str, "data": lambda v, n: v}, frozenset()),
    "CANCEL": (Cancel, {"stream_id": _int}, frozenset({"stream_id"})),
    "STATUS": (Status, {"stream_id": _int}, frozenset({"stream_id"})),
    "TOKENIZE": (
        Tokenize,
        {"stream_id": _int, "text": _str, "add_special_tokens": _bool},
        frozenset({"stream_id", "text"}),
    ),
    "DETOKENIZE": (Detokenize, {"stream_id": _int, "tokens": _tokens}, frozenset({"stream_id", "tokens"})),
    "OPEN_SESSION": (OpenSession, {"stream_id": _int, "model": _str}, frozenset({"stream_id"})),
    "CLOSE_SESSION": (CloseSession, _SESSION_ID, frozenset(_SESSION_ID)),
    "DUMP_SESSION": (DumpSession, _SESSION_ID, frozenset(_SESSION_ID)),
    "FORK_SESSION": (
        ForkSession,
        {**_SESSION_ID, "at_position": lambda v, n: _int(v, n, 0)},
        frozenset({*_SESSION_ID, "at_position"}),
    ),
    "SESSION_GENERATE": (SessionGenerate, _SESSION_GENERATE, frozenset({*_SESSION_ID, "offset"})),
    "DEFINE_CONCEPT": (DefineConcept, _DEFINE_CONCEPT, frozenset({"stream_id", "name"})),
    "DELETE_CONCEPT": (DeleteConcept, {"stream_id": _int, "name": _str}, frozenset({"stream_id", "name"})),
    "SAVE_CONCEPTS": (SaveConcepts, {"stream_id": _int}, frozenset({"stream_id"})),
    "PATCH_SWEEP": (PatchSweep, _PATCH_SWEEP, frozenset({"stream_id", "clean", "corrupted", "answer"})),
    "IMAGE_INFO": (
        ImageInfo,
        {"stream_id": _int, "data": _base64, "mime": _str},
        frozenset({"stream_id", "data", "mime"}),
    ),
}
# Fields of which a message holds exactly one: the prompt as token ids, or as chat messages.
ALTERNATIVES: dict[str, tuple[str, str]] = {"GENERATE": ("prompt", "messages"), "SCORE": ("prompt", "messages")}
