"""Interventions in their JSON form (LMTP's `steer`, the REPL, the gRPC client's dicts).

Shape errors raise InvalidArgument naming the field; names, layers and values are checked
against the model by steering.Directions.resolve.
"""

from __future__ import annotations

from collections.abc import Mapping

from salience.core.probes.steering import MAX_RANGES, Intervention, Op, Range, check_count
from salience.errors import InvalidArgument, under

__all__ = ["object_of", "parse_interventions", "parse_layers", "parse_vector"]


_FIELDS = {"direction", "vector", "feature", "sae", "layers", "layer", "op", "value", "lo", "hi", "positions"}


def parse_interventions(data: object) -> tuple[Intervention, ...]:
    """Interventions from their JSON form:

        {"direction": "french", "layers": [12] | 12 | "10-14", "op": "add", "value": 8,
         "positions": "generated" | "prompt" | "all" | [[start, end], ...] | {"ranges": [...], "generated": true}}

    Shape errors raise InvalidArgument; names, layers and values are checked by Directions.resolve.
    """
    if not isinstance(data, list):
        raise InvalidArgument("steer must be a list of interventions", field="steer")
    check_count(len(data))
    return tuple(_parse_one(n, item) for n, item in enumerate(data))


def object_of(where: str, item: object, known: set[str]) -> Mapping:
    """`item` as a JSON object holding only `known` fields (an intervention, a patch), else
    InvalidArgument naming `where`."""
    if not isinstance(item, Mapping):
        raise InvalidArgument(f"{where} must be an object", field=where)
    unknown = sorted(set(item) - known)
    if unknown:
        raise InvalidArgument(f"{where}: unknown field {unknown[0]!r}", field=where)
    return item


def _parse_one(n: int, item: object) -> Intervention:
    where = f"steer[{n}]"
    item = object_of(where, item, _FIELDS)
    direction = item.get("direction", "")
    vector = None
    if "vector" in item:
        with under(where):
            vector = parse_vector(f"{where}: vector", item["vector"])
    feature = _parse_feature(where, item) if "feature" in item else None
    if "sae" in item and feature is None:
        raise InvalidArgument(f"{where}: sae names the SAE of a feature: give the feature too", field=where)
    if not isinstance(direction, str) or (not direction and vector is None and feature is None):
        raise InvalidArgument(f"{where}: direction must be a name (or give a vector or a feature)", field=where)
    try:
        op = Op(item.get("op", "add"))
    except ValueError:
        raise InvalidArgument(
            f"{where}: op must be one of {[op.value for op in Op]}, got {item.get('op')!r}", field=where
        ) from None
    if "layer" in item and "layers" in item:
        raise InvalidArgument(f"{where}: give layer or layers, not both", field=where)
    given = item.get("layers", item.get("layer"))
    layers = () if feature is not None and given is None else parse_layers(where, given)  # (): the SAE's layer
    value = item.get("value", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{where}: value must be a number, got {value!r}", field=where)
    bounds = {}
    for name in ("lo", "hi"):
        bound = item.get(name)
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
            raise InvalidArgument(f"{where}: {name} must be a number, got {bound!r}", field=where)
        bounds[name] = bound
    prompt, ranges, generated = _parse_positions(where, item.get("positions", "generated"))
    return Intervention(
        direction=direction,
        vector=vector,
        feature=feature,
        layers=layers,
        op=op,
        value=value,
        prompt=prompt,
        ranges=ranges,
        generated=generated,
        **bounds,
    )


def _parse_feature(where: str, item: Mapping) -> tuple[str | None, int]:
    feature, sae = item["feature"], item.get("sae")
    if type(feature) is not int or feature < 0:
        raise InvalidArgument(f"{where}: feature must be a feature id (an integer >= 0), got {feature!r}", field=where)
    if sae is not None and not isinstance(sae, str):
        raise InvalidArgument(f"{where}: sae must name an SAE, got {sae!r}", field=where)
    return sae, feature


def parse_vector(where: str, data: object) -> bytes:
    """A float32 vector from JSON: base64 of its little-endian bytes, or a list of numbers. Its
    size and values are checked where the model's shape is known. Its errors name no field (`where`
    is the message's, not always a path): the caller's `under` gives it."""
    if isinstance(data, str):
        import base64
        import binascii

        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"{where} is not valid base64") from None
        if len(raw) % 4:
            raise InvalidArgument(f"{where} holds {len(raw)} bytes, not a whole number of float32 values")
        return raw
    if isinstance(data, list) and data and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in data):
        import struct

        try:
            return struct.pack(f"<{len(data)}f", *data)
        except OverflowError:
            raise InvalidArgument(f"{where} holds a value too large for float32") from None
    raise InvalidArgument(f"{where} must be base64 float32 bytes or a non-empty list of numbers")


def parse_layers(where: str, layers: object) -> tuple[int, ...]:
    """An int, a list of ints, or "A-B" (inclusive)."""
    if type(layers) is int:
        return (layers,)
    if isinstance(layers, str):
        first, dash, last = layers.partition("-")
        if dash and first.strip().isdigit() and last.strip().isdigit() and int(first) <= int(last):
            return tuple(range(int(first), int(last) + 1))
        raise InvalidArgument(f'{where}: layers {layers!r} is not a layer range like "10-14"', field=where)
    if isinstance(layers, list) and layers and all(type(x) is int for x in layers):
        return tuple(layers)
    raise InvalidArgument(
        f'{where}: layers must be a layer, a non-empty list of layers or "A-B", got {layers!r}', field=where
    )


def _parse_positions(where: str, positions: object) -> tuple[bool, tuple[Range, ...], bool]:
    named = {"generated": (False, True), "prompt": (True, False), "all": (True, True)}
    if isinstance(positions, str):
        if positions not in named:
            raise InvalidArgument(
                f"{where}: positions must be one of {list(named)} or ranges, got {positions!r}", field=where
            )
        prompt, generated = named[positions]
        return prompt, (), generated
    if isinstance(positions, Mapping):
        extra = sorted(set(positions) - {"ranges", "generated", "prompt"})
        if extra:
            raise InvalidArgument(f"{where}: unknown positions field {extra[0]!r}", field=where)
        prompt, generated = positions.get("prompt", False), positions.get("generated", False)
        if type(prompt) is not bool or type(generated) is not bool:
            raise InvalidArgument(
                f"{where}: positions.prompt and positions.generated must be true or false", field=where
            )
        return prompt, _parse_ranges(where, positions.get("ranges", [])), generated
    return False, _parse_ranges(where, positions), False


def _parse_ranges(where: str, ranges: object) -> tuple[Range, ...]:
    if not isinstance(ranges, list):
        raise InvalidArgument(f"{where}: ranges must be a list of [start, end]", field=where)
    if len(ranges) > MAX_RANGES:
        raise InvalidArgument(f"{where}: {len(ranges)} ranges; at most {MAX_RANGES} are allowed", field=where)
    out = []
    for r, pair in enumerate(ranges):
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            raise InvalidArgument(f"{where}: range {r} must be [start, end], got {pair!r}", field=where)
        out.append((pair[0], pair[1]))
    return tuple(out)
