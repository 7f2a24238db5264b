"""Activation patching: per-request replacement of the activation at a hook point, and its checks.

Theory of operation. A request carries a list of `Patch`es. Each names a site (a hook point of a
layer, models/points.py), absolute positions, and the float32 values the activation takes there:
one row per position (the rows of another run, as residual rows give them), or one row for
every position (a mean ablation). The model goes on from the patched value: later layers, and the
readouts and SAEs at that site, see it (TransformerLens's hook returning a new activation).

A server patches at the points `--patch-points` names, at every layer (`PatchSites`): the loader
puts a tap at each such site (taps.py), which runs the op `salience::patch` (tap_ops.py). The
worker (patch_worker.py) hands that op each step's rows and values; a step that patches nowhere
costs one dictionary check per site. The same taps copy residual rows out at their sites, which is
how a request reads rows at a point other than the readouts' (engine/rows.py).

A patched request's KV is computed under its patches: `cache_salt` keys it by their content, so
it is found only by a request stating the same patches, never by an unpatched one, nor the
reverse.

Everything is checked here, before a request reaches vLLM: InvalidArgument names the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from salience.core.models.points import POINTS, Point, Site, parse_hook
from salience.core.probes.steering_json import object_of, parse_vector
from salience.errors import InvalidArgument, ModelError, under

__all__ = [
    "MAX_PATCHES",
    "MAX_PATCH_ROWS",
    "NO_PATCHES",
    "Patch",
    "PatchSites",
    "ResolvedPatches",
    "parse_patches",
    "patch_salt",
]

MAX_PATCHES = 64  # per request: sites x layers a request patches
MAX_PATCH_ROWS = 4096  # per request: rows it carries, all patches together
_FIELDS = {"point", "hook", "layer", "positions", "rows"}


@dataclass(frozen=True, kw_only=True)
class Patch:
    """The activation at `point` of `layer` set to `rows` at absolute `positions`: float32 bytes,
    [len(positions), hidden] (row i at positions[i]) or [1, hidden] (that row at every one)."""

    point: Point
    layer: int
    positions: tuple[int, ...]
    rows: bytes

    @property
    def site(self) -> Site:
        return Site(self.layer, self.point)


@dataclass(frozen=True)
class ResolvedPatches:
    """A request's patches, checked: what the worker applies and the cache is salted with."""

    patches: tuple[Patch, ...]
    slots: tuple[int, ...] = ()  # each patch's site slot (PatchSites.slot)

    def __bool__(self) -> bool:
        return bool(self.patches)

    def payload(self) -> list:
        """The worker's form (SamplingParams.extra_args): [slot, positions, rows bytes] each."""
        return [[slot, list(p.positions), p.rows] for p, slot in zip(self.patches, self.slots, strict=True)]

    def cache_salt(self) -> str | None:
        """A digest of what the patches write (None without patches): see patch_salt."""
        if not self.patches:
            return None
        digest = hashlib.sha256()
        for p in sorted(self.patches, key=lambda p: (p.site, p.positions)):
            digest.update(f"{p.site}:{','.join(map(str, p.positions))}:".encode())
            digest.update(hashlib.sha256(p.rows).digest())
        return "salience-patch-" + digest.hexdigest()


NO_PATCHES = ResolvedPatches(())


def patch_salt(*salts: str | None) -> str | None:
    """One request's cache_salt from its steering's and its patches' (None: neither): KV computed
    under both is found only by a request stating both."""
    given = [salt for salt in salts if salt]
    if len(given) < 2:
        return given[0] if given else None
    return "salience-" + hashlib.sha256("\n".join(given).encode()).hexdigest()


class PatchSites:
    """The sites a server patches at: every layer of each of `points` (in POINTS order), slot
    point-major. `capture_base` is the first residual-capture slot of the patch taps (the readout
    taps' own come first: tap_ops.Capture)."""

    def __init__(self, points: Sequence[Point], num_layers: int, hidden_size: int, capture_base: int = 0) -> None:
        self.points: tuple[Point, ...] = tuple(p for p in POINTS if p in points)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.capture_base = capture_base

    def __len__(self) -> int:
        return len(self.points) * self.num_layers

    def slot(self, site: Site) -> int:
        return self.points.index(site.point) * self.num_layers + site.layer

    def capture_slot(self, site: Site) -> int:
        return self.capture_base + self.slot(site)

    def manifest(self) -> dict:
        """What clients are told: where they can patch, and the limits."""
        return {
            "points": list(self.points),
            "layers": self.num_layers,
            "max_patches": MAX_PATCHES,
            "max_rows": MAX_PATCH_ROWS,
        }

    def resolve(self, patches: Sequence[Patch], length: int) -> ResolvedPatches:
        """Check a request's patches against this server and a prompt of `length` tokens."""
        if not patches:
            return NO_PATCHES
        if len(patches) > MAX_PATCHES:
            raise InvalidArgument(
                f"patch has {len(patches)} patches; at most {MAX_PATCHES} are allowed per request", field="patch"
            )
        seen: dict[Site, set[int]] = {}
        rows = 0
        for n, p in enumerate(patches):
            where = f"patch[{n}]"
            if not isinstance(p, Patch):
                raise InvalidArgument(f"{where} is not a patch", field=where)
            if p.point not in self.points:
                served = ", ".join(self.points) or "none: --patch-points is off"
                raise InvalidArgument(f"{where}: this server patches no {p.point!r} (it patches {served})", field=where)
            if type(p.layer) is not int or not 0 <= p.layer < self.num_layers:
                raise InvalidArgument(
                    f"{where}: layer {p.layer!r} is not a layer of this model (0..{self.num_layers - 1})", field=where
                )
            if not p.positions:
                raise InvalidArgument(f"{where}: names no positions", field=where)
            bad = [q for q in p.positions if type(q) is not int or not 0 <= q < length]
            if bad:
                raise InvalidArgument(
                    f"{where}: position {bad[0]!r} is not in the prompt (0..{length - 1})", field=f"{where}.positions"
                )
            taken = seen.setdefault(p.site, set())
            if len(set(p.positions)) < len(p.positions) or taken.intersection(p.positions):
                raise InvalidArgument(f"{where}: patches a position of {p.site} twice", field=f"{where}.positions")
            taken.update(p.positions)
            rows += self._check_rows(where, p)
            if rows > MAX_PATCH_ROWS:
                raise InvalidArgument(
                    f"patch carries more than {MAX_PATCH_ROWS} rows; patch in several requests", field="patch"
                )
        return ResolvedPatches(tuple(patches), tuple(self.slot(p.site) for p in patches))

    def _check_rows(self, where: str, p: Patch) -> int:
        import numpy as np

        width = 4 * self.hidden_size
        if not isinstance(p.rows, bytes) or len(p.rows) % width:
            raise InvalidArgument(
                f"{where}: rows hold {len(p.rows) // 4 if isinstance(p.rows, bytes) else '?'} values, "
                f"not whole rows of the model's hidden size {self.hidden_size}",
                field=f"{where}.rows",
            )
        n = len(p.rows) // width
        if n not in (1, len(p.positions)):
            raise InvalidArgument(
                f"{where}: {n} rows for {len(p.positions)} positions (give one row per position, or one for all)",
                field=f"{where}.rows",
            )
        if not np.isfinite(np.frombuffer(p.rows, dtype=np.float32)).all():
            raise InvalidArgument(f"{where}: rows hold NaN or inf", field=f"{where}.rows")
        return n


def parse_patches(data: object) -> tuple[Patch, ...]:
    """Patches from their JSON form (LMTP's `patch`, the OpenAI extension's):

        {"point": "resid_pre", "layer": 3, "positions": [4, 5],
         "rows": [[...], [...]] | [...] | "base64 float32"}

    or `"hook": "blocks.3.hook_resid_pre"` for point and layer. `rows` is one row per position,
    or one row for every position. Sizes and values are checked against the model by
    PatchSites.resolve."""
    if not isinstance(data, list):
        raise InvalidArgument("patch must be a list of patches", field="patch")
    if len(data) > MAX_PATCHES:
        raise InvalidArgument(
            f"patch has {len(data)} patches; at most {MAX_PATCHES} are allowed per request", field="patch"
        )
    return tuple(_parse_one(n, item) for n, item in enumerate(data))


def _parse_one(n: int, item: object) -> Patch:
    where = f"patch[{n}]"
    item = object_of(where, item, _FIELDS)
    if "hook" in item:
        if "point" in item or "layer" in item:
            raise InvalidArgument(f"{where}: give hook, or point and layer, not both", field=where)
        try:
            site = parse_hook(item["hook"]) if isinstance(item["hook"], str) else None
        except (ValueError, ModelError) as e:
            raise InvalidArgument(f"{where}: {e}", field=f"{where}.hook") from None
        if site is None:
            raise InvalidArgument(f"{where}: hook must be a hook name", field=f"{where}.hook")
        point, layer = site.point, site.layer
    else:
        point, layer = item.get("point", "resid_post"), item.get("layer")
        if point not in POINTS:
            raise InvalidArgument(
                f"{where}: point must be one of {list(POINTS)}, got {point!r}", field=f"{where}.point"
            )
        if type(layer) is not int:
            raise InvalidArgument(f"{where}: layer must be an integer, got {layer!r}", field=f"{where}.layer")
    positions = item.get("positions")
    if type(positions) is int:
        positions = [positions]
    if not isinstance(positions, list) or not all(type(q) is int for q in positions):
        raise InvalidArgument(f"{where}: positions must be a list of integers", field=f"{where}.positions")
    if "rows" not in item:
        raise InvalidArgument(f"{where}: rows are missing (the values to patch in)", field=f"{where}.rows")
    rows = item["rows"]
    with under(f"{where}.rows"):
        if isinstance(rows, list) and rows and all(isinstance(r, list) for r in rows):
            raw = b"".join(parse_vector(f"{where}: rows[{i}]", r) for i, r in enumerate(rows))
        else:
            raw = parse_vector(f"{where}: rows", rows)
    return Patch(point=point, layer=layer, positions=tuple(positions), rows=raw)
