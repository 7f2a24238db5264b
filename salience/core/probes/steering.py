"""Concept steering: per-request interventions on the residual stream, and their checks.

Theory of operation. A request carries a list of `Intervention`s. Each names a direction (a
concept of the loaded concept set, or a vector of the `--steering` set), one or more layers,
an operation and the positions it applies to. With d the direction's unit vector at layer L
and h the residual stream after layer L at a covered position:

    add     h += value * d
    set     h += (value - <h, d>) * d        so that <h', d> = value
    ablate  h -= <h, d> * d                  set with value 0

All three are `h += (a + b * <h, d>) * d` with (a, b) = (value, 0), (value, -1), (0, -1). That
is what the model computes (taps.py): per token row and tap layer a coefficient pair
per direction, zero for rows nobody steers, so an unsteered row's residual gets exactly 0.0
added. Several interventions at one layer and position are each computed from the residual
*before* any of them and summed (their coefficients add); with non-orthogonal directions a
`set` is then exact only along its own direction when the others leave it alone.

Positions: `prompt` (every position of the call's prompt), `ranges` (absolute positions
[start, end), which may reach into generated ones) and `generated` (every token the call
decodes). `resolve` turns them into absolute ranges against the call's prompt length; that
absolute form is what reaches the worker and what `cache_salt` hashes, so a later pass over
prompt + completion (the last token's readout, a SCORE of the same text) that states the same
absolute interventions reads the same cache entries, and nothing else does.

Everything is checked here, before a request reaches vLLM: InvalidArgument names the field.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from salience.errors import InvalidArgument, ModelError

if TYPE_CHECKING:  # clients parse interventions without the server's libraries
    import torch

    from salience.core.probes.concepts import ConceptSet

__all__ = [
    "MAX_INTERVENTIONS",
    "MAX_MAGNITUDE",
    "MAX_RANGES",
    "Directions",
    "Intervention",
    "Op",
    "ResolvedSteer",
    "parse_interventions",
]

MAX_INTERVENTIONS = 16  # per request
MAX_RANGES = 64  # position ranges per intervention
MAX_MAGNITUDE = 1e4  # |value|: residual projections of real models are in the tens to thousands
END = 2**62  # "to the end" in absolute ranges (the readout ranges' bound)

Range = tuple[int, int]


class Op(enum.Enum):
    ADD = "add"
    SET = "set"
    ABLATE = "ablate"


@dataclass(frozen=True, kw_only=True)
class Intervention:
    """One intervention; see the module docstring. `value` is alpha for add, the target
    projection for set, and must be 0 for ablate."""

    direction: str
    layers: tuple[int, ...]
    op: Op
    value: float = 0.0
    prompt: bool = False
    ranges: tuple[Range, ...] = ()
    generated: bool = False

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of h += (a + b * <h, d>) * d."""
        return {Op.ADD: (self.value, 0.0), Op.SET: (self.value, -1.0), Op.ABLATE: (0.0, -1.0)}[self.op]


@dataclass(frozen=True)
class ResolvedSteer:
    """A request's interventions in absolute form: what the worker applies and the cache is salted with."""

    interventions: tuple[Intervention, ...]

    def __bool__(self) -> bool:
        return bool(self.interventions)

    def payload(self, directions: Directions) -> list:
        """The worker's form (SamplingParams.extra_args): [layers, column, a, b, ranges] each."""
        out = []
        for i in self.interventions:
            a, b = i.coefficients()
            out.append([list(i.layers), directions.column(i.direction), a, b, [list(r) for r in i.ranges]])
        return out

    def cache_salt(self) -> str | None:
        """vLLM's per-request cache_salt: KV computed under these interventions is found only by a
        request stating the same ones. None without interventions (the unsteered cache)."""
        if not self.interventions:
            return None
        canonical = sorted(
            json.dumps([i.direction, i.layers, i.op.value, float(i.value).hex(), i.ranges]) for i in self.interventions
        )
        return "salience-steer-" + hashlib.sha256("\n".join(canonical).encode()).hexdigest()


class Directions:
    """The directions a server can steer along: the concept set's concepts, then the steering
    set's vectors, each defined at the layers its set holds. Column k of layer L's matrix is
    direction k's unit vector there (zero where it has none)."""

    def __init__(self, concepts: ConceptSet | None, steering: ConceptSet | None) -> None:
        sets = [s for s in (concepts, steering) if s is not None]
        if not sets:
            raise ModelError("steering needs a concept set or a steering set")
        if concepts is not None and steering is not None:
            if (concepts.hidden_size, concepts.num_layers) != (steering.hidden_size, steering.num_layers):
                raise ModelError("the steering set and the concept set are for models of different shapes")
            shared = sorted(set(concepts.concepts) & set(steering.concepts))
            if shared:
                raise ModelError(f"the steering set names {shared}, which the concept set names too")
        self.hidden_size = sets[0].hidden_size
        self.num_layers = sets[0].num_layers
        self.names: tuple[str, ...] = tuple(name for s in sets for name in s.concepts)
        self._sets = sets
        self._column = {name: k for k, name in enumerate(self.names)}
        self.defined_at: dict[str, frozenset[int]] = {name: frozenset(s.layers) for s in sets for name in s.concepts}
        self.layers: tuple[int, ...] = tuple(sorted(set().union(*(s.layers for s in sets))))
        for s in sets:
            for layer, vectors in s.vectors.items():
                zero = [s.concepts[k] for k, norm in enumerate(vectors.norm(dim=1).tolist()) if norm == 0]
                if zero:
                    raise ModelError(f"{zero[0]!r} is the zero vector at layer {layer}: it cannot be steered along")

    def manifest(self) -> dict:
        """What clients are told (LMTP MODEL_INFO, gRPC GetSteeringManifest): each direction's
        layers, and the limits."""
        return {
            "directions": {name: sorted(self.defined_at[name]) for name in self.names},
            "max_interventions": MAX_INTERVENTIONS,
            "max_magnitude": MAX_MAGNITUDE,
        }

    def column(self, name: str) -> int:
        return self._column[name]

    def matrix(self, layer: int) -> torch.Tensor:
        """[hidden, directions] float32: unit columns, normalised in float64."""
        import torch

        out = torch.zeros(self.hidden_size, len(self.names), dtype=torch.float64)
        first = 0
        for s in self._sets:
            if layer in s.vectors:
                vectors = s.vectors[layer].to(torch.float64)
                out[:, first : first + len(s.concepts)] = (vectors / vectors.norm(dim=1, keepdim=True)).T
            first += len(s.concepts)
        return out.to(torch.float32)

    # ---- checks ------------------------------------------------------------------

    def resolve(self, interventions: Sequence[Intervention], prompt_len: int) -> ResolvedSteer:
        """Check a request's interventions and make their positions absolute: `prompt` is
        [0, prompt_len), `generated` is [prompt_len, end)."""
        if not isinstance(interventions, Sequence) or isinstance(interventions, (str, bytes)):
            raise InvalidArgument("steer must be a list of interventions")
        if len(interventions) > MAX_INTERVENTIONS:
            raise InvalidArgument(
                f"steer has {len(interventions)} interventions; at most {MAX_INTERVENTIONS} are allowed per request"
            )
        resolved = []
        for n, intervention in enumerate(interventions):
            if not isinstance(intervention, Intervention):
                raise InvalidArgument(f"steer[{n}] is not an intervention")
            self._check(n, intervention)
            ranges = list(intervention.ranges)
            if intervention.prompt:
                ranges.append((0, prompt_len))
            if intervention.generated:
                ranges.append((prompt_len, END))
            resolved.append(
                dataclasses.replace(
                    intervention,
                    layers=tuple(sorted(set(intervention.layers))),
                    value=float(intervention.value),
                    prompt=False,
                    generated=False,
                    ranges=_merge(ranges),
                )
            )
        return ResolvedSteer(tuple(resolved))

    def _check(self, n: int, i: Intervention) -> None:
        where = f"steer[{n}]"
        if i.direction not in self._column:
            raise InvalidArgument(f"{where}: unknown direction {i.direction!r}; this server has {list(self.names)}")
        if not isinstance(i.op, Op):
            raise InvalidArgument(f"{where}: op must be one of {[op.value for op in Op]}, got {i.op!r}")
        if not i.layers:
            raise InvalidArgument(f"{where}: names no layer")
        for layer in i.layers:
            if type(layer) is not int or not 0 <= layer < self.num_layers:
                raise InvalidArgument(
                    f"{where}: layer {layer!r} is not a layer of this model (0..{self.num_layers - 1})"
                )
            if layer not in self.defined_at[i.direction]:
                raise InvalidArgument(
                    f"{where}: direction {i.direction!r} has no vector at layer {layer} "
                    f"(it has {sorted(self.defined_at[i.direction])})"
                )
        value = i.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(f"{where}: value must be a finite number, got {value!r}")
        if abs(value) > MAX_MAGNITUDE:
            raise InvalidArgument(f"{where}: |value| must be at most {MAX_MAGNITUDE:g}, got {value!r}")
        if i.op is Op.ABLATE and value != 0:
            raise InvalidArgument(f"{where}: ablate takes no value (it sets the projection to 0)")
        if not (i.prompt or i.ranges or i.generated):
            raise InvalidArgument(f"{where}: names no positions (prompt, ranges or generated)")
        if len(i.ranges) > MAX_RANGES:
            raise InvalidArgument(f"{where}: {len(i.ranges)} ranges; at most {MAX_RANGES} are allowed")
        for r, pair in enumerate(i.ranges):
            try:
                start, end = pair
            except (TypeError, ValueError):
                raise InvalidArgument(f"{where}: range {r} must be [start, end]") from None
            if type(start) is not int or type(end) is not int or not 0 <= start < end <= END:
                raise InvalidArgument(f"{where}: range {r} must satisfy 0 <= start < end, got [{start!r}, {end!r}]")


def _merge(ranges: list[Range]) -> tuple[Range, ...]:
    """Sorted, overlapping and touching ranges joined: one canonical form per position set."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((s, e) for s, e in merged)


# ---- the JSON form (LMTP, the REPL) ----------------------------------------------------

_FIELDS = {"direction", "layers", "layer", "op", "value", "positions"}


def parse_interventions(data: object) -> tuple[Intervention, ...]:
    """Interventions from their JSON form:

        {"direction": "french", "layers": [12] | 12 | "10-14", "op": "add", "value": 8,
         "positions": "generated" | "prompt" | "all" | [[start, end], ...] | {"ranges": [...], "generated": true}}

    Shape errors raise InvalidArgument; names, layers and values are checked by Directions.resolve.
    """
    if not isinstance(data, list):
        raise InvalidArgument("steer must be a list of interventions")
    if len(data) > MAX_INTERVENTIONS:
        raise InvalidArgument(
            f"steer has {len(data)} interventions; at most {MAX_INTERVENTIONS} are allowed per request"
        )
    return tuple(_parse_one(n, item) for n, item in enumerate(data))


def _parse_one(n: int, item: object) -> Intervention:
    where = f"steer[{n}]"
    if not isinstance(item, Mapping):
        raise InvalidArgument(f"{where} must be an object")
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise InvalidArgument(f"{where}: unknown field {unknown[0]!r}")
    direction = item.get("direction")
    if not isinstance(direction, str):
        raise InvalidArgument(f"{where}: direction must be a name")
    try:
        op = Op(item.get("op", "add"))
    except ValueError:
        raise InvalidArgument(f"{where}: op must be one of {[op.value for op in Op]}, got {item.get('op')!r}") from None
    if "layer" in item and "layers" in item:
        raise InvalidArgument(f"{where}: give layer or layers, not both")
    layers = parse_layers(where, item.get("layers", item.get("layer")))
    value = item.get("value", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"{where}: value must be a number, got {value!r}")
    prompt, ranges, generated = _parse_positions(where, item.get("positions", "generated"))
    return Intervention(
        direction=direction, layers=layers, op=op, value=value, prompt=prompt, ranges=ranges, generated=generated
    )


def parse_layers(where: str, layers: object) -> tuple[int, ...]:
    """An int, a list of ints, or "A-B" (inclusive)."""
    if type(layers) is int:
        return (layers,)
    if isinstance(layers, str):
        first, dash, last = layers.partition("-")
        if dash and first.strip().isdigit() and last.strip().isdigit() and int(first) <= int(last):
            return tuple(range(int(first), int(last) + 1))
        raise InvalidArgument(f'{where}: layers {layers!r} is not a layer range like "10-14"')
    if isinstance(layers, list) and layers and all(type(x) is int for x in layers):
        return tuple(layers)
    raise InvalidArgument(f'{where}: layers must be a layer, a non-empty list of layers or "A-B", got {layers!r}')


def _parse_positions(where: str, positions: object) -> tuple[bool, tuple[Range, ...], bool]:
    named = {"generated": (False, True), "prompt": (True, False), "all": (True, True)}
    if isinstance(positions, str):
        if positions not in named:
            raise InvalidArgument(f"{where}: positions must be one of {list(named)} or ranges, got {positions!r}")
        prompt, generated = named[positions]
        return prompt, (), generated
    if isinstance(positions, Mapping):
        extra = sorted(set(positions) - {"ranges", "generated", "prompt"})
        if extra:
            raise InvalidArgument(f"{where}: unknown positions field {extra[0]!r}")
        prompt, generated = positions.get("prompt", False), positions.get("generated", False)
        if type(prompt) is not bool or type(generated) is not bool:
            raise InvalidArgument(f"{where}: positions.prompt and positions.generated must be true or false")
        return prompt, _parse_ranges(where, positions.get("ranges", [])), generated
    return False, _parse_ranges(where, positions), False


def _parse_ranges(where: str, ranges: object) -> tuple[Range, ...]:
    if not isinstance(ranges, list):
        raise InvalidArgument(f"{where}: ranges must be a list of [start, end]")
    if len(ranges) > MAX_RANGES:
        raise InvalidArgument(f"{where}: {len(ranges)} ranges; at most {MAX_RANGES} are allowed")
    out = []
    for r, pair in enumerate(ranges):
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)):
            raise InvalidArgument(f"{where}: range {r} must be [start, end], got {pair!r}")
        out.append((pair[0], pair[1]))
    return tuple(out)
