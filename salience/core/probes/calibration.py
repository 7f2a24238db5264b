"""Readout rows as probabilities, and monitors that act on those probabilities while text is generated.

A calibrated concept set publishes, per concept and read layer, the logistic maps the builder
fitted (probes/fitting.py), one per view of a readout (`ReadoutView`):
- `token`: p = 1 / (1 + exp(-(scale * raw + offset))), the token's own readout;
- `running`: the same with `running_scale` and `running_offset`, applied to the mean raw readout
  over the positions the request has read so far: p that the text so far has the concept.
Position 0 (the first token, where every model parks its massive activations) is never read as
a probability, nor counted in a running mean: both views give it None. `Calibration` applies
the maps to whole readout rows (layer-major, as they stream), in float64.

A monitor watches one concept at one layer on every generated token: `above: t` holds when
p > t, `below: t` when p < t. `stop` ends the generation at the first token where it holds;
`flag` reports each token where it starts to hold (it did not hold on the previous generated
token, or there was none). Evaluation is pure Python on rows the engine already has, so the
module stays importable without torch or numpy: clients parse monitors with it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from salience.core.features.served import ServedSAE, pick_sae
from salience.errors import InvalidArgument

__all__ = [
    "MAX_MONITORS",
    "Action",
    "Calibration",
    "Monitor",
    "MonitorEvent",
    "MonitorState",
    "ReadoutView",
    "calibrated",
    "parse_monitors",
]

MAX_MONITORS = 16  # per request


def calibrated(info: Mapping | None) -> bool:
    """Whether a concept_info entry carries a calibration (a built concept; not one made by hand
    or given as raw vectors)."""
    return bool(info and info.get("layers"))


def _logistic(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _mapped(scale: Sequence[float], offset: Sequence[float], row: Sequence[float]) -> tuple[float | None, ...]:
    return tuple(None if s != s else _logistic(s * r + o) for s, r, o in zip(scale, row, offset, strict=True))


class ReadoutView(enum.Enum):
    """What a readout value shows: the raw projection, or a probability in one of two views."""

    RAW = "raw"
    TOKEN = "token"
    RUNNING = "running"

    @staticmethod
    def named(name: str) -> ReadoutView:
        """A wire's name for a view; "probability" (the name before there were two) is `token`."""
        return ReadoutView.TOKEN if name == "probability" else ReadoutView(name)


Presenter = Callable[[int, Sequence[float]], tuple]  # (position, raw row) -> the row as shown


@dataclass(frozen=True)
class Calibration:
    """Every concept's logistic maps at every read layer, in readout-row order."""

    concepts: tuple[str, ...]
    layers: tuple[int, ...]
    scale: tuple[float, ...]  # [layers * concepts], layer-major: the token view
    offset: tuple[float, ...]
    recommended: Mapping[str, int]  # concept -> its recommended layer
    running_scale: tuple[float, ...] = ()  # the running view (empty: a set built before it)
    running_offset: tuple[float, ...] = ()

    @staticmethod
    def of(concepts: Sequence[str], layers: Sequence[int], concept_info: Sequence[dict | None]) -> Calibration:
        """From a manifest's concept_info. A concept without calibration (a live concept given as raw
        vectors) reads None as a probability; InvalidArgument if no concept has one."""
        if len(concept_info) != len(concepts) or not any(map(calibrated, concept_info)):
            raise InvalidArgument(
                f"the concept set has no calibration for {', '.join(concepts)}: probabilities and "
                "monitors need a set built by `salience concepts build` (raw readouts still work)"
            )
        maps: dict[str, list[float]] = {key: [] for key in ("scale", "offset", "running_scale", "running_offset")}
        fits = [{fit["layer"]: fit for fit in info["layers"]} if calibrated(info) else None for info in concept_info]
        for layer in layers:
            for name, by_layer in zip(concepts, fits, strict=True):
                if by_layer is not None and layer not in by_layer:
                    raise InvalidArgument(f"concept {name!r} has no calibration at layer {layer}")
                for key, values in maps.items():
                    values.append(math.nan if by_layer is None else float(by_layer[layer].get(key, math.nan)))
        recommended = {
            name: int(info["recommended_layer"])
            for name, info in zip(concepts, concept_info, strict=True)
            if calibrated(info)
        }
        running = any(s == s for s in maps["running_scale"])
        return Calibration(
            tuple(concepts),
            tuple(layers),
            tuple(maps["scale"]),
            tuple(maps["offset"]),
            recommended,
            tuple(maps["running_scale"]) if running else (),
            tuple(maps["running_offset"]) if running else (),
        )

    def probabilities(self, row: Sequence[float]) -> tuple[float | None, ...]:
        """The token view of one row (a concept without calibration: None)."""
        return _mapped(self.scale, self.offset, row)

    def presenter(self, view: ReadoutView) -> Presenter | None:
        """How a request's rows are shown in `view`, called in position order (None: raw, as read).
        The running view keeps the sums of the rows it has seen, so each request needs its own."""
        if view is ReadoutView.RAW:
            return None
        if view is ReadoutView.TOKEN:
            return lambda position, row: self.unread if position == 0 else self.probabilities(row)
        if not self.running_scale:
            raise InvalidArgument(
                "the concept set was built before running calibrations: rebuild it with `salience concepts build` "
                "for the running view (token and raw work)"
            )
        sums = [0.0] * len(self.running_scale)
        count = 0

        def running(position: int, row: Sequence[float]) -> tuple:
            nonlocal count
            if position == 0:
                return self.unread
            count += 1
            for i, value in enumerate(row):
                sums[i] += value
            return _mapped(self.running_scale, self.running_offset, [total / count for total in sums])

        return running

    @property
    def unread(self) -> tuple[None, ...]:
        """The first token's row in a probability view: not read."""
        return (None,) * len(self.scale)

    def probability(self, row: Sequence[float], index: int) -> float:
        return _logistic(self.scale[index] * row[index] + self.offset[index])

    def running_probability(self, mean: float, index: int) -> float:
        """The running view of one value: `mean` is the mean raw readout at row index `index`
        over the positions read so far (position 0 left out)."""
        return _logistic(self.running_scale[index] * mean + self.running_offset[index])

    def index(self, concept: str, layer: int) -> int:
        return self.layers.index(layer) * len(self.concepts) + self.concepts.index(concept)


class Action(enum.Enum):
    FLAG = "flag"
    STOP = "stop"


@dataclass(frozen=True, kw_only=True)
class Monitor:
    """One monitor as a request states it: `layer` None means the concept's recommended layer;
    exactly one of `above` and `below` is set. A feature monitor (`feature` set, `concept` empty)
    watches an SAE feature's activation instead of a concept's probability."""

    concept: str
    action: Action
    above: float | None = None
    below: float | None = None
    layer: int | None = None
    feature: int | None = None
    sae: str | None = None  # a feature monitor's SAE (None: the only one served)

    def holds(self, p: float) -> bool:
        return p > self.above if self.above is not None else p < self.below  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorEvent:
    """A monitor that fired at a generated token: `flag` where it started to hold, `stop` where it ended the
    generation. `monitor` is its index in the request's list."""

    monitor: int
    concept: str  # "" for a feature monitor
    layer: int
    position: int
    probability: float  # a feature monitor's: the feature's activation
    action: Action
    feature: int | None = None
    sae: str | None = None

    @property
    def subject(self) -> str:
        """What it watched, as a finish reason names it: the concept, or feature:SAE:ID."""
        return self.concept if self.feature is None else f"feature:{self.sae}:{self.feature}"

    def as_dict(self) -> dict[str, Any]:
        watched = (
            {"concept": self.concept, "probability": self.probability}
            if self.feature is None
            else {"sae": self.sae, "feature": self.feature, "activation": self.probability}
        )
        return {
            "monitor": self.monitor,
            **watched,
            "layer": self.layer,
            "position": self.position,
            "action": self.action.value,
        }


def parse_monitors(items: Any) -> tuple[Monitor, ...]:
    """Monitors from their JSON form (LMTP's `monitors`), every field checked; InvalidArgument names it.
    Whether the concept and layer exist is the engine's check (MonitorState.start)."""
    if not isinstance(items, list):
        raise InvalidArgument("monitors must be a list of {concept, above|below, action[, layer]} objects")
    if len(items) > MAX_MONITORS:
        raise InvalidArgument(f"{len(items)} monitors asked for; at most {MAX_MONITORS} per request")
    monitors = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidArgument(f"monitor {i} must be an object")
        unknown = set(item) - {"concept", "layer", "above", "below", "action", "feature", "sae"}
        if unknown:
            raise InvalidArgument(f"monitor {i}: unknown field(s) {', '.join(sorted(unknown))}")
        try:
            action = Action(item.get("action"))
        except ValueError:
            raise InvalidArgument(
                f"monitor {i}: 'action' must be 'flag' or 'stop', got {item.get('action')!r}"
            ) from None
        if "feature" in item or "sae" in item:
            monitors.append(_feature_monitor(i, item, action))
            continue
        concept = item.get("concept")
        if not isinstance(concept, str) or not concept:
            raise InvalidArgument(f"monitor {i}: 'concept' must name a concept (or give a feature)")
        layer = item.get("layer")
        if layer is not None and (type(layer) is not int or layer < 0):
            raise InvalidArgument(f"monitor {i}: 'layer' must be a layer index, got {layer!r}")
        monitors.append(
            Monitor(concept=concept, layer=layer, action=action, **_threshold(i, item.get("above"), item.get("below")))
        )
    return tuple(monitors)


def _feature_monitor(i: int, item: dict, action: Action) -> Monitor:
    feature, sae = item.get("feature"), item.get("sae")
    if "concept" in item or "layer" in item:
        raise InvalidArgument(f"monitor {i}: a feature monitor watches its SAE's layer: give no concept or layer")
    if type(feature) is not int or feature < 0:
        raise InvalidArgument(f"monitor {i}: 'feature' must be a feature id (an integer >= 0), got {feature!r}")
    if sae is not None and not isinstance(sae, str):
        raise InvalidArgument(f"monitor {i}: 'sae' must name an SAE, got {sae!r}")
    return Monitor(
        concept="", feature=feature, sae=sae, action=action, **_threshold(i, item.get("above"), item.get("below"), True)
    )


def _threshold(i: int, above: Any, below: Any, activation: bool = False) -> dict[str, float]:
    if (above is None) == (below is None):
        raise InvalidArgument(f"monitor {i}: give exactly one of 'above' and 'below'")
    name, value = ("above", above) if above is not None else ("below", below)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"monitor {i}: '{name}' must be a number, got {value!r}")
    if activation:
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"monitor {i}: '{name}' must be an activation >= 0, got {value!r}")
    elif not 0 < value < 1:
        raise InvalidArgument(f"monitor {i}: '{name}' must be a probability strictly between 0 and 1, got {value!r}")
    return {name: float(value)}


class MonitorState:
    """A generation's monitors, checked against the served set and SAEs, stepping token by token.

    A feature monitor reads the feature's activation from the token's top features (the SAE's
    `top`, which the engine asks for on every generated token): exact for a top-k SAE, whose
    active features all fit; for another SAE, a feature active beyond its `top` reads 0."""

    def __init__(
        self, monitors: Sequence[Monitor], calibration: Calibration | None, saes: Sequence[ServedSAE] = ()
    ) -> None:
        concepts = [m for m in monitors if m.feature is None]
        if concepts and calibration is None:
            raise InvalidArgument("monitors need concept readouts, and this server has no concept set loaded")
        self._watch: list[tuple[Monitor, int, int]] = []  # monitor, its layer, its concept's index in a row
        self.sae: ServedSAE | None = None  # the SAE feature monitors watch (one per request)
        for i, monitor in enumerate(monitors):
            if monitor.feature is not None:
                self._watch.append((monitor, *self._feature(i, monitor, saes)))
                continue
            assert calibration is not None
            if monitor.concept not in calibration.concepts:
                raise InvalidArgument(
                    f"monitor {i}: unknown concept {monitor.concept!r}; known: {', '.join(calibration.concepts)}"
                )
            if monitor.concept not in calibration.recommended:
                raise InvalidArgument(
                    f"monitor {i}: concept {monitor.concept!r} has no calibration (it was given as raw vectors): "
                    "it cannot be monitored as a probability"
                )
            layer = calibration.recommended[monitor.concept] if monitor.layer is None else monitor.layer
            if layer not in calibration.layers:
                raise InvalidArgument(
                    f"monitor {i}: layer {layer} is not read; read layers are {calibration.layers[0]}.."
                    f"{calibration.layers[-1]} ({len(calibration.layers)} of them)"
                )
            self._watch.append((monitor, layer, calibration.index(monitor.concept, layer)))
        self._calibration = calibration
        self._held = [False] * len(self._watch)

    def _feature(self, i: int, monitor: Monitor, saes: Sequence[ServedSAE]) -> tuple[int, int]:
        served = pick_sae(saes, monitor.sae, f"monitor {i}")
        if self.sae is not None and served is not self.sae:
            raise InvalidArgument(f"monitor {i}: one request's feature monitors watch one SAE, here {self.sae.name!r}")
        if not 0 <= monitor.feature < served.sae.d_sae:  # type: ignore[operator]
            raise InvalidArgument(f"monitor {i}: feature {monitor.feature} is outside SAE {served.name!r}")
        self.sae = served
        return served.layer, -1

    @property
    def concepts(self) -> bool:
        """Whether any monitor watches a concept (and needs every generated token's readouts)."""
        return any(m.feature is None for m, _, _ in self._watch)

    def __bool__(self) -> bool:
        return bool(self._watch)

    def step(
        self, position: int, row: Sequence[float] | None, features: Sequence[tuple[int, float]] | None = None
    ) -> tuple[MonitorEvent, ...]:
        """The events at one generated token, in monitor order; a `stop` among them ends the
        generation. `row`: its readouts; `features`: its top features of the watched SAE."""
        events = []
        active = dict(features or ())
        for i, (monitor, layer, index) in enumerate(self._watch):
            if monitor.feature is None:
                assert self._calibration is not None and row is not None
                p = self._calibration.probability(row, index)
            else:
                p = active.get(monitor.feature, 0.0)
            holds = monitor.holds(p)
            fires = holds if monitor.action is Action.STOP else holds and not self._held[i]
            self._held[i] = holds
            if fires:
                events.append(
                    MonitorEvent(
                        monitor=i,
                        concept=monitor.concept,
                        layer=layer,
                        position=position,
                        probability=p,
                        action=monitor.action,
                        feature=monitor.feature,
                        sae=self.sae.name if monitor.feature is not None and self.sae else None,
                    )
                )
        return tuple(events)
