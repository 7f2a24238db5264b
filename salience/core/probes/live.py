"""The served concepts: the loaded set, plus concepts defined while the server runs.

Theory of operation. The taps' readout matrices and steering directions have a fixed number of
columns, fixed when the graph is compiled: the loaded set's concepts, then `spare` columns that
start as zeros (taps.py). A live concept takes a free spare column: its vectors are written into
that column of every tap between two engine steps (one collective_rpc, which vLLM runs between
steps, so no step sees half of them), and the compiled graph reads it from the next step on. No
new graph: the matrices are the same tensors, with other values.

Every request reads the table through a `ConceptView`, the snapshot current when it started:
which concepts, in which columns, in which order. The worker copies out only that view's
columns, so a stream's readout width and order never change, whatever is defined or deleted
meanwhile. A deleted concept leaves the views at once, but its column keeps its vectors until the
last request holding a view with it has ended; only then is it zeroed and free again. So a column
is never reused under a request that still reads or steers it.

Pure bookkeeping (no engine calls): the engine (engine/live.py) writes the workers' columns.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from salience.core.models.points import Point
from salience.core.probes.calibration import Calibration
from salience.core.probes.concepts import ConceptSet, ReadoutManifest
from salience.core.probes.steering import ResolvedSteer
from salience.errors import InvalidArgument, ResourceExhausted

__all__ = ["MAX_NAME", "ConceptTable", "ConceptView", "LiveConcept", "VectorColumns", "check_vectors"]

MAX_NAME = 64  # characters in a concept's name


@dataclass(frozen=True, eq=False)
class LiveConcept:
    name: str
    column: int  # in the buffers: after the loaded set's columns
    vectors: Mapping[int, torch.Tensor]  # read layer -> [hidden] float32, read as given
    info: dict | None  # concept_info (validation, calibration); None for a concept given as raw vectors

    @functools.cached_property
    def identity(self) -> str:
        """What its vectors are: steering along it is cached (cache_salt) under this."""
        h = hashlib.sha256(self.name.encode())
        for layer in sorted(self.vectors):
            h.update(self.vectors[layer].to(torch.float32).contiguous().numpy().tobytes())
        return f"live:{self.name}:{h.hexdigest()[:32]}"


@dataclass(frozen=True, eq=False)
class ConceptView:
    """The concepts one request reads and steers along, fixed for its whole life."""

    version: int
    concepts: tuple[str, ...]
    columns: tuple[int, ...]  # each concept's column in the taps' buffers
    layers: tuple[int, ...]
    hidden_size: int
    info: tuple[dict | None, ...]
    point: Point = "resid_post"  # the concept set's, where every concept here reads (live ones too)
    live: frozenset[str] = field(default_factory=frozenset)
    identities: Mapping[str, str] = field(default_factory=dict)  # live concept -> LiveConcept.identity

    @property
    def manifest(self) -> ReadoutManifest:
        return ReadoutManifest(
            concepts=self.concepts,
            layers=self.layers,
            hidden_size=self.hidden_size,
            concept_info=self.info,
            point=self.point,
            version=self.version,
            live=tuple(name for name in self.concepts if name in self.live),
        )

    @functools.cached_property
    def calibration(self) -> Calibration:
        return Calibration.of(self.concepts, self.layers, self.info)

    @functools.cached_property
    def directions(self) -> dict[str, tuple[int, str]]:
        """Each live concept's column and identity: what steering.Directions.resolve takes."""
        return {name: (self.columns[self.concepts.index(name)], self.identities[name]) for name in self.live}


class ConceptTable:
    """The loaded set's concepts in columns 0..n-1 and `spare` columns for live ones."""

    def __init__(self, loaded: ConceptSet, spare: int) -> None:
        self.loaded = loaded
        self.spare = spare
        self.width = len(loaded.concepts) + spare  # columns in the taps' buffers
        self._live: dict[str, LiveConcept] = {}
        self._pending: set[str] = set()  # names being defined (fitting or writing)
        self._retiring: dict[int, int] = {}  # column -> the last version that still held it
        self._users: Counter[int] = Counter()  # version -> requests holding a view of it
        self._version = 0
        self._view = self._make_view()

    # ---- views ---------------------------------------------------------------------------

    @property
    def view(self) -> ConceptView:
        return self._view

    def acquire(self) -> ConceptView:
        """The current view, held until `release`: its columns stay as they are meanwhile."""
        self._users[self._view.version] += 1
        return self._view

    def release(self, view: ConceptView) -> list[int]:
        """Let go of a view; returns the deleted concepts' columns that no request holds any more
        (the caller zeroes them in the workers, then calls `free`)."""
        self._users[view.version] -= 1
        if self._users[view.version] <= 0:
            del self._users[view.version]
        return self.unheld()

    def unheld(self) -> list[int]:
        oldest = min(self._users, default=math.inf)
        return [column for column, last in self._retiring.items() if last < oldest]

    def free(self, columns: list[int]) -> None:
        for column in columns:
            self._retiring.pop(column, None)

    def _make_view(self) -> ConceptView:
        loaded = self.loaded
        info = loaded.info or (None,) * len(loaded.concepts)
        live = list(self._live.values())
        return ConceptView(
            version=self._version,
            concepts=(*loaded.concepts, *(c.name for c in live)),
            columns=(*range(len(loaded.concepts)), *(c.column for c in live)),
            layers=loaded.layers,
            hidden_size=loaded.hidden_size,
            point=loaded.point,
            info=(*info, *({**c.info, "live": True} if c.info else {"name": c.name, "live": True} for c in live)),
            live=frozenset(self._live),
            identities={c.name: c.identity for c in live},
        )

    # ---- define and delete ----------------------------------------------------------------

    def reserve(self, name: str) -> None:
        """Claim `name` before fitting; InvalidArgument if it is taken, ResourceExhausted if no
        column is free. `commit` or `abandon` ends the claim."""
        check_name(name)
        if name in self.loaded.concepts:
            raise InvalidArgument(f"{name!r} is a concept of the loaded set; choose another name", field="name")
        if name in self._live or name in self._pending:
            raise InvalidArgument(
                f"a live concept named {name!r} exists already (DELETE_CONCEPT it first)", field="name"
            )
        if self._free_column(len(self._pending)) is None:
            raise ResourceExhausted(
                f"no free concept column: this server has {self.spare} spare columns (--spare-concepts), "
                f"{len(self._live)} held by live concepts, {len(self._retiring)} by deleted ones still read by "
                f"running requests, {len(self._pending)} by defines in progress"
            )
        self._pending.add(name)

    def abandon(self, name: str) -> None:
        self._pending.discard(name)

    def column_for(self, name: str) -> int:
        """The column a reserved name will take."""
        assert name in self._pending
        column = self._free_column(0)
        assert column is not None  # reserve counted the pending ones
        return column

    def commit(self, concept: LiveConcept) -> ConceptView:
        self._pending.discard(concept.name)
        self._live[concept.name] = concept
        self._version += 1
        self._view = self._make_view()
        return self._view

    def delete(self, name: str) -> LiveConcept:
        concept = self._live.get(name)
        if concept is None:
            if name in self.loaded.concepts:
                raise InvalidArgument(
                    f"{name!r} belongs to the loaded concept set; only live concepts can be deleted", field="name"
                )
            raise InvalidArgument(f"no live concept named {name!r}", field="name")
        del self._live[name]
        self._retiring[concept.column] = self._version
        self._version += 1
        self._view = self._make_view()
        return concept

    def live(self) -> list[LiveConcept]:
        return list(self._live.values())

    def _free_column(self, skip: int) -> int | None:
        """The first free spare column after `skip` others (those pending defines will take)."""
        taken = {c.column for c in self._live.values()} | set(self._retiring)
        free = [c for c in range(len(self.loaded.concepts), self.width) if c not in taken]
        return free[skip] if skip < len(free) else None

    # ---- saving ------------------------------------------------------------------------------

    def served_set(self) -> ConceptSet:
        """The loaded set plus every live concept, as one concept set a server can load."""
        loaded, live = self.loaded, list(self._live.values())
        vectors = {
            layer: torch.cat([loaded.vectors[layer], *(c.vectors[layer][None] for c in live)])
            for layer in loaded.layers
        }
        info = [*(loaded.info or (None,) * len(loaded.concepts)), *(c.info for c in live)]
        return dataclasses.replace(
            loaded,
            concepts=(*loaded.concepts, *(c.name for c in live)),
            vectors=vectors,
            info=tuple(info) if any(info) else (),
            provenance={**loaded.provenance, "live_concepts": [c.name for c in live]},
        )


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable() or name != name.strip():
        raise InvalidArgument(
            f"a concept name is 1..{MAX_NAME} printable characters without surrounding spaces, got {name!r}",
            field="name",
        )


def check_vectors(vectors: Mapping[int, torch.Tensor], layers: tuple[int, ...], hidden: int) -> None:
    """A raw live concept: one finite, non-zero float32 [hidden] vector per read layer."""
    missing = [layer for layer in layers if layer not in vectors]
    extra = sorted(set(vectors) - set(layers))
    if missing or extra:
        raise InvalidArgument(
            f"a concept's vectors are given for every read layer ({layers[0]}..{layers[-1]}, {len(layers)} of them): "
            + (f"missing {missing}" if missing else f"layers {extra} are not read"),
            field="vectors",
        )
    for layer, vector in vectors.items():
        if tuple(vector.shape) != (hidden,):
            raise InvalidArgument(
                f"the vector at layer {layer} has {vector.numel()} values; the model's hidden size is {hidden}",
                field="vectors",
            )
        if not torch.isfinite(vector).all():
            raise InvalidArgument(f"the vector at layer {layer} holds NaN or inf", field="vectors")
        if not vector.abs().max() > 0:
            raise InvalidArgument(f"the vector at layer {layer} is zero: it has no direction", field="vectors")


class VectorColumns:
    """The taps' columns for requests' own vectors: one per distinct vector among running requests."""

    def __init__(self, columns: range) -> None:
        self._free = list(columns)
        self._held: dict[str, tuple[int, int]] = {}  # identity -> (column, requests holding it)

    def claim(self, steer: ResolvedSteer) -> ResolvedSteer:
        """`steer` with its vectors' columns filled in; ResourceExhausted if too few are free.
        Release it when the request is over."""
        wanted = {i.identity for i in steer.interventions if i.vector is not None}
        new = [identity for identity in wanted if identity not in self._held]
        if len(new) > len(self._free):
            raise ResourceExhausted(
                f"{len(new)} new steering vectors, {len(self._free)} vector columns free: this server steers along "
                f"at most {len(self._free) + len(self._held)} distinct request vectors at once (--steer-vectors)"
            )
        for identity in wanted:
            column, users = self._held.get(identity) or (self._free.pop(0), 0)
            self._held[identity] = (column, users + 1)
        columns = tuple(
            self._held[i.identity][0] if i.vector is not None else column
            for i, column in zip(steer.interventions, steer.columns, strict=True)
        )
        return dataclasses.replace(steer, columns=columns)

    def release(self, steer: ResolvedSteer) -> None:
        for identity in {i.identity for i in steer.interventions if i.vector is not None}:
            column, users = self._held[identity]
            if users > 1:
                self._held[identity] = (column, users - 1)
            else:
                del self._held[identity]
                self._free.append(column)

    def in_use(self) -> int:
        return len(self._held)
