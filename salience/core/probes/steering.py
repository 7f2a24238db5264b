"""Concept steering: per-request interventions on the residual stream, and their checks.

Theory of operation. A request carries a list of `Intervention`s. Each names a direction (a
concept of the loaded concept set, or a vector of the `--steering` set), one or more layers,
an operation and the positions it applies to. With d the direction's unit vector at layer L
and h the residual stream after layer L at a covered position:

    add     h += value * d
    set     h += (value - <h, d>) * d        so that <h', d> = value
    ablate  h -= <h, d> * d                  set with value 0
    cap     h += (clamp(<h, d>, lo, hi) - <h, d>) * d     the projection kept within [lo, hi]

The first three are `h += (a + b * <h, d>) * d` with (a, b) = (value, 0), (value, -1), (0, -1);
a cap adds `(clamp(<h, d>, lo, hi) - <h, d>) * d`, which is exactly 0 where the projection is in
range (activation capping: it acts only where the concept is present beyond the bound). That is
what the model computes (taps.py): per token row, tap layer and direction a coefficient pair and
a bound pair, (0, 0) and (-inf, inf) for rows nobody steers, so an unsteered row's residual gets
exactly 0.0 added. Several interventions at one layer and position are each computed from the
residual *before* any of them and summed (their coefficients add; caps meeting there intersect
their ranges); with non-orthogonal directions a `set` is then exact only along its own direction
when the others leave it alone.

A direction is a concept of the loaded set, a vector of the steering set, a live concept
(probes/live.py), or a vector the request itself carries (`vector`, float32 [hidden]): that one
takes a free vector column of the taps for the request's life (`VectorColumns`); requests that
carry the same vector share it.

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
    "check_count",
    "manifest",
    "merge_ranges",
    "unit",
]

MAX_INTERVENTIONS = 16  # per request
MAX_RANGES = 64  # position ranges per intervention
MAX_MAGNITUDE = 1e4  # |value|: residual projections of real models are in the tens to thousands
END = 2**62  # "to the end" in absolute ranges (the readout ranges' bound)

Range = tuple[int, int]
LiveDirection = tuple[int, str]  # a live concept's readout column and identity (live.ConceptView.directions)


class Op(enum.Enum):
    ADD = "add"
    SET = "set"
    ABLATE = "ablate"
    CAP = "cap"


@dataclass(frozen=True, kw_only=True)
class Intervention:
    """One intervention; see the module docstring. `value` is alpha for add, the target
    projection for set, and must be 0 for ablate and cap; `lo` and `hi` bound a cap (either may be
    None: unbounded). `direction` names a direction, or is "" when `vector` (float32 [hidden]
    bytes) is the direction. `identity` is set by Directions.resolve: what the direction's values
    are (a live concept or a vector may change under one name), for the cache salt."""

    direction: str
    layers: tuple[int, ...]
    op: Op
    value: float = 0.0
    prompt: bool = False
    ranges: tuple[Range, ...] = ()
    generated: bool = False
    lo: float | None = None
    hi: float | None = None
    vector: bytes | None = None
    identity: str = ""
    feature: tuple[str | None, int] | None = None  # (SAE, feature id): its decoder row (features/served.py)

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of h += (a + b * <h, d>) * d."""
        return {Op.ADD: (self.value, 0.0), Op.SET: (self.value, -1.0), Op.ABLATE: (0.0, -1.0), Op.CAP: (0.0, 0.0)}[
            self.op
        ]

    def bounds(self) -> tuple[float, float]:
        """A cap's [lo, hi]; (-inf, inf) leaves the projection alone."""
        lo, hi = (self.lo, self.hi) if self.op is Op.CAP else (None, None)
        return (-math.inf if lo is None else lo, math.inf if hi is None else hi)


@dataclass(frozen=True)
class ResolvedSteer:
    """A request's interventions in absolute form: what the worker applies and the cache is salted with."""

    interventions: tuple[Intervention, ...]
    columns: tuple[int, ...] = ()  # each intervention's column in the taps' directions

    def __bool__(self) -> bool:
        return bool(self.interventions)

    def payload(self) -> list:
        """The worker's form (SamplingParams.extra_args), each intervention as [layers, column, a, b,
        ranges, lo, hi, vector]: vector is [identity, float32 bytes] for a request's own vector
        (the worker writes it into its column), else None."""
        out = []
        for i, column in zip(self.interventions, self.columns, strict=True):
            a, b = i.coefficients()
            lo, hi = i.bounds()
            vector = [i.identity, i.vector] if i.vector is not None else None
            out.append([list(i.layers), column, a, b, [list(r) for r in i.ranges], lo, hi, vector])
        return out

    def cache_salt(self) -> str | None:
        """vLLM's per-request cache_salt: KV computed under these interventions is found only by a
        request stating the same ones. None without interventions (the unsteered cache)."""
        if not self.interventions:
            return None
        canonical = sorted(
            json.dumps([i.identity or i.direction, i.layers, i.op.value, float(i.value).hex(), i.ranges, *i.bounds()])
            for i in self.interventions
        )
        return "salience-steer-" + hashlib.sha256("\n".join(canonical).encode()).hexdigest()


class Directions:
    """The directions a server can steer along: the concept set's concepts, then the steering
    set's vectors, each defined at the layers its set holds, then `spare` columns for live
    concepts (in the order of the concept table's spare columns) and `vectors` columns for
    requests' own vectors. Column k of layer L's matrix is direction k's unit vector there (zero
    where it has none, and in every spare and vector column until something is written there)."""

    def __init__(
        self, concepts: ConceptSet | None, steering: ConceptSet | None, *, spare: int = 0, vectors: int = 0
    ) -> None:
        sets = [s for s in (concepts, steering) if s is not None]
        if not sets:
            raise ModelError("steering needs a concept set or a steering set")
        if concepts is not None and steering is not None:
            if (concepts.hidden_size, concepts.num_layers) != (steering.hidden_size, steering.num_layers):
                raise ModelError("the steering set and the concept set are for models of different shapes")
            shared = sorted(set(concepts.concepts) & set(steering.concepts))
            if shared:
                raise ModelError(f"the steering set names {shared}, which the concept set names too")
            if concepts.point != steering.point:
                raise ModelError(
                    f"the steering set steers at {steering.point} and the concept set reads {concepts.point}: "
                    "steering acts where readouts read, so they must be one point"
                )
        self.hidden_size = sets[0].hidden_size
        self.num_layers = sets[0].num_layers
        self.point = sets[0].point  # where in each layer every direction steers
        self.names: tuple[str, ...] = tuple(name for s in sets for name in s.concepts)
        self._sets = sets
        self._column = {name: k for k, name in enumerate(self.names)}
        self._loaded_concepts = len(concepts.concepts) if concepts is not None else 0
        self.spare = spare if concepts is not None else 0  # live concepts need readouts
        self.vector_columns = range(len(self.names) + self.spare, len(self.names) + self.spare + vectors)
        self.width = len(self.names) + self.spare + vectors
        self.defined_at: dict[str, frozenset[int]] = {name: frozenset(s.layers) for s in sets for name in s.concepts}
        self.layers: tuple[int, ...] = tuple(sorted(set().union(*(s.layers for s in sets))))
        for s in sets:
            for layer, vectors_at in s.vectors.items():
                zero = [s.concepts[k] for k, norm in enumerate(vectors_at.norm(dim=1).tolist()) if norm == 0]
                if zero:
                    raise ModelError(f"{zero[0]!r} is the zero vector at layer {layer}: it cannot be steered along")

    def manifest(self, live: Mapping[str, LiveDirection] | None = None) -> dict:
        """What clients are told (LMTP MODEL_INFO, gRPC GetSteeringManifest): each direction's
        layers (live ones included), and the limits."""
        directions = {name: sorted(self.defined_at[name]) for name in self.names}
        for name in sorted(live or ()):
            directions[name] = list(self.layers)
        return manifest(directions, len(self.vector_columns))

    def column(self, name: str) -> int:
        return self._column[name]

    def live_column(self, readout_column: int) -> int:
        """The steering column of the live concept in readout column `readout_column`."""
        return len(self.names) + readout_column - self._loaded_concepts

    def matrix(self, layer: int) -> torch.Tensor:
        """[hidden, width] float32: unit columns, normalised in float64; spare and vector columns zero."""
        import torch

        out = torch.zeros(self.hidden_size, self.width, dtype=torch.float64)
        first = 0
        for s in self._sets:
            if layer in s.vectors:
                out[:, first : first + len(s.concepts)] = unit(s.vectors[layer]).T
            first += len(s.concepts)
        return out.to(torch.float32)

    # ---- checks ------------------------------------------------------------------

    def resolve(
        self, interventions: Sequence[Intervention], prompt_len: int, live: Mapping[str, LiveDirection] | None = None
    ) -> ResolvedSteer:
        """Check a request's interventions (named directions also against `live`, the live concepts the
        request sees) and make their positions absolute: `prompt` is [0, prompt_len), `generated`
        is [prompt_len, end). A request vector's column is -1 until VectorColumns.claim."""
        if not isinstance(interventions, Sequence) or isinstance(interventions, (str, bytes)):
            raise InvalidArgument("steer must be a list of interventions", field="steer")
        check_count(len(interventions))
        resolved, columns = [], []
        for n, intervention in enumerate(interventions):
            if not isinstance(intervention, Intervention):
                raise InvalidArgument(f"steer[{n}] is not an intervention", field=f"steer[{n}]")
            column, identity = self._check(n, intervention, live or {})
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
                    lo=None if intervention.lo is None else float(intervention.lo),
                    hi=None if intervention.hi is None else float(intervention.hi),
                    prompt=False,
                    generated=False,
                    ranges=merge_ranges(ranges),
                    identity=identity,
                )
            )
            columns.append(column)
        return ResolvedSteer(tuple(resolved), tuple(columns))

    def _direction(
        self, where: str, i: Intervention, live: Mapping[str, LiveDirection]
    ) -> tuple[int, str, frozenset[int]]:
        """The direction's column, identity (for the cache salt) and the layers it is defined at."""
        if i.vector is not None:
            if i.direction:
                raise InvalidArgument(f"{where}: give a direction or a vector, not both", field=where)
            if not self.vector_columns:
                raise InvalidArgument(f"{where}: this server takes no request vectors (--steer-vectors 0)", field=where)
            if not isinstance(i.vector, bytes) or len(i.vector) != 4 * self.hidden_size:
                size = len(i.vector) // 4 if isinstance(i.vector, bytes) else "?"
                raise InvalidArgument(
                    f"{where}: vector has {size} values; the model's hidden size is {self.hidden_size}", field=where
                )
            import numpy as np

            values = np.frombuffer(i.vector, dtype=np.float32)
            if not np.isfinite(values).all():
                raise InvalidArgument(f"{where}: vector holds NaN or inf", field=where)
            if not np.abs(values).max() > 0:
                raise InvalidArgument(f"{where}: vector is zero: it has no direction", field=where)
            return -1, "vector:" + hashlib.sha256(i.vector).hexdigest(), frozenset(self.layers)
        if i.direction in self._column:
            return self._column[i.direction], i.direction, self.defined_at[i.direction]
        if i.direction in live:
            readout_column, identity = live[i.direction]
            return self.live_column(readout_column), identity, frozenset(self.layers)
        known = [*self.names, *sorted(live)]
        raise InvalidArgument(f"{where}: unknown direction {i.direction!r}; this server has {known}", field=where)

    def _check(self, n: int, i: Intervention, live: Mapping[str, LiveDirection]) -> tuple[int, str]:
        where = f"steer[{n}]"
        if not isinstance(i.op, Op):
            raise InvalidArgument(f"{where}: op must be one of {[op.value for op in Op]}, got {i.op!r}", field=where)
        column, identity, defined_at = self._direction(where, i, live)
        if not i.layers:
            raise InvalidArgument(f"{where}: names no layer", field=where)
        for layer in i.layers:
            if type(layer) is not int or not 0 <= layer < self.num_layers:
                raise InvalidArgument(
                    f"{where}: layer {layer!r} is not a layer of this model (0..{self.num_layers - 1})", field=where
                )
            if layer not in defined_at:
                raise InvalidArgument(
                    f"{where}: direction {i.direction or 'vector'!r} has no vector at layer {layer} "
                    f"(it has {sorted(defined_at)})",
                    field=where,
                )
        value = i.value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidArgument(f"{where}: value must be a finite number, got {value!r}", field=where)
        if abs(value) > MAX_MAGNITUDE:
            raise InvalidArgument(f"{where}: |value| must be at most {MAX_MAGNITUDE:g}, got {value!r}", field=where)
        if i.op in (Op.ABLATE, Op.CAP) and value != 0:
            raise InvalidArgument(f"{where}: {i.op.value} takes no value (use lo and hi for a cap)", field=where)
        _check_bounds(where, i)
        if not (i.prompt or i.ranges or i.generated):
            raise InvalidArgument(f"{where}: names no positions (prompt, ranges or generated)", field=where)
        if len(i.ranges) > MAX_RANGES:
            raise InvalidArgument(f"{where}: {len(i.ranges)} ranges; at most {MAX_RANGES} are allowed", field=where)
        for r, pair in enumerate(i.ranges):
            try:
                start, end = pair
            except (TypeError, ValueError):
                raise InvalidArgument(f"{where}: range {r} must be [start, end]", field=where) from None
            if type(start) is not int or type(end) is not int or not 0 <= start < end <= END:
                raise InvalidArgument(
                    f"{where}: range {r} must satisfy 0 <= start < end, got [{start!r}, {end!r}]", field=where
                )
        return column, identity


def _check_bounds(where: str, i: Intervention) -> None:
    if i.op is not Op.CAP:
        if i.lo is not None or i.hi is not None:
            raise InvalidArgument(f"{where}: lo and hi bound a cap; op {i.op.value} takes none", field=where)
        return
    if i.lo is None and i.hi is None:
        raise InvalidArgument(f"{where}: a cap needs lo, hi or both", field=where)
    for name, bound in (("lo", i.lo), ("hi", i.hi)):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
            raise InvalidArgument(f"{where}: {name} must be a finite number, got {bound!r}", field=where)
        if abs(bound) > MAX_MAGNITUDE:
            raise InvalidArgument(f"{where}: |{name}| must be at most {MAX_MAGNITUDE:g}, got {bound!r}", field=where)
    if i.lo is not None and i.hi is not None and i.lo > i.hi:
        raise InvalidArgument(f"{where}: lo {i.lo!r} is above hi {i.hi!r}", field=where)


def unit(vectors: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm, in float64: what the taps steer along."""
    rows = vectors.double()
    return rows / rows.norm(dim=-1, keepdim=True)


def merge_ranges(ranges: list[Range]) -> tuple[Range, ...]:
    """Sorted, overlapping and touching ranges joined: one canonical form per position set."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((s, e) for s, e in merged)


def manifest(directions: Mapping[str, list[int]], vector_columns: int) -> dict:
    """A steering manifest: the directions' layers and the limits every request is held to (a
    server with nothing to steer along tells its limits with no direction)."""
    return {
        "directions": dict(directions),
        "max_interventions": MAX_INTERVENTIONS,
        "max_magnitude": MAX_MAGNITUDE,
        "vector_columns": vector_columns,
        "ops": [op.value for op in Op],
    }


def check_count(n: int) -> None:
    """A request's number of interventions within the limit (checked by the JSON reader before it
    reads them, and again on what any wire built)."""
    if n > MAX_INTERVENTIONS:
        raise InvalidArgument(
            f"steer has {n} interventions; at most {MAX_INTERVENTIONS} are allowed per request", field="steer"
        )
