"""Readout rows as probabilities, and monitors that act on those probabilities while text is generated.

A calibrated concept set publishes, per concept and read layer, the logistic map the builder
fitted (probes/fitting.py): p = 1 / (1 + exp(-(scale * raw + offset))). `Calibration` applies
it to whole readout rows (layer-major, as they stream), in float64.

A monitor watches one concept at one layer on every generated token: `above: t` holds when
p > t, `below: t` when p < t. `stop` ends the generation at the first token where it holds;
`flag` reports each token where it starts to hold (it did not hold on the previous generated
token, or there was none). Evaluation is pure Python on rows the engine already has, so the
module stays importable without torch or numpy: clients parse monitors with it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from salience.errors import InvalidArgument

__all__ = [
    "MAX_MONITORS",
    "Action",
    "Calibration",
    "Monitor",
    "MonitorEvent",
    "MonitorState",
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


@dataclass(frozen=True)
class Calibration:
    """Every concept's logistic map at every read layer, in readout-row order."""

    concepts: tuple[str, ...]
    layers: tuple[int, ...]
    scale: tuple[float, ...]  # [layers * concepts], layer-major
    offset: tuple[float, ...]
    recommended: Mapping[str, int]  # concept -> its recommended layer

    @staticmethod
    def of(concepts: Sequence[str], layers: Sequence[int], concept_info: Sequence[dict | None]) -> Calibration:
        """From a manifest's concept_info. A concept without calibration (a live concept given as raw
        vectors) reads None as a probability; InvalidArgument if no concept has one."""
        if len(concept_info) != len(concepts) or not any(map(calibrated, concept_info)):
            raise InvalidArgument(
                f"the concept set has no calibration for {', '.join(concepts)}: probabilities and "
                "monitors need a set built by `salience concepts build` (raw readouts still work)"
            )
        scale, offset = [], []
        fits = [{fit["layer"]: fit for fit in info["layers"]} if calibrated(info) else None for info in concept_info]
        for layer in layers:
            for name, by_layer in zip(concepts, fits, strict=True):
                if by_layer is None:
                    scale.append(math.nan)
                    offset.append(math.nan)
                    continue
                if layer not in by_layer:
                    raise InvalidArgument(f"concept {name!r} has no calibration at layer {layer}")
                scale.append(float(by_layer[layer]["scale"]))
                offset.append(float(by_layer[layer]["offset"]))
        recommended = {
            name: int(info["recommended_layer"])
            for name, info in zip(concepts, concept_info, strict=True)
            if calibrated(info)
        }
        return Calibration(tuple(concepts), tuple(layers), tuple(scale), tuple(offset), recommended)

    def probabilities(self, row: Sequence[float]) -> tuple[float | None, ...]:
        return tuple(
            None if s != s else _logistic(s * r + o) for s, r, o in zip(self.scale, row, self.offset, strict=True)
        )

    def probability(self, row: Sequence[float], index: int) -> float:
        return _logistic(self.scale[index] * row[index] + self.offset[index])

    def index(self, concept: str, layer: int) -> int:
        return self.layers.index(layer) * len(self.concepts) + self.concepts.index(concept)


class Action(enum.Enum):
    FLAG = "flag"
    STOP = "stop"


@dataclass(frozen=True, kw_only=True)
class Monitor:
    """One monitor as a request states it: `layer` None means the concept's recommended layer;
    exactly one of `above` and `below` is set."""

    concept: str
    action: Action
    above: float | None = None
    below: float | None = None
    layer: int | None = None

    def holds(self, p: float) -> bool:
        return p > self.above if self.above is not None else p < self.below  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True, slots=True)
class MonitorEvent:
    """A monitor that fired at a generated token: `flag` where it started to hold, `stop` where it ended the
    generation. `monitor` is its index in the request's list."""

    monitor: int
    concept: str
    layer: int
    position: int
    probability: float
    action: Action

    def as_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "concept": self.concept,
            "layer": self.layer,
            "position": self.position,
            "probability": self.probability,
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
        unknown = set(item) - {"concept", "layer", "above", "below", "action"}
        if unknown:
            raise InvalidArgument(f"monitor {i}: unknown field(s) {', '.join(sorted(unknown))}")
        concept = item.get("concept")
        if not isinstance(concept, str) or not concept:
            raise InvalidArgument(f"monitor {i}: 'concept' must name a concept")
        layer = item.get("layer")
        if layer is not None and (type(layer) is not int or layer < 0):
            raise InvalidArgument(f"monitor {i}: 'layer' must be a layer index, got {layer!r}")
        try:
            action = Action(item.get("action"))
        except ValueError:
            raise InvalidArgument(
                f"monitor {i}: 'action' must be 'flag' or 'stop', got {item.get('action')!r}"
            ) from None
        monitors.append(
            Monitor(concept=concept, layer=layer, action=action, **_threshold(i, item.get("above"), item.get("below")))
        )
    return tuple(monitors)


def _threshold(i: int, above: Any, below: Any) -> dict[str, float]:
    if (above is None) == (below is None):
        raise InvalidArgument(f"monitor {i}: give exactly one of 'above' and 'below'")
    name, value = ("above", above) if above is not None else ("below", below)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise InvalidArgument(f"monitor {i}: '{name}' must be a probability strictly between 0 and 1, got {value!r}")
    return {name: float(value)}


class MonitorState:
    """A generation's monitors, checked against the served set, stepping token by token."""

    def __init__(self, monitors: Sequence[Monitor], calibration: Calibration | None) -> None:
        if monitors and calibration is None:
            raise InvalidArgument("monitors need concept readouts, and this server has no concept set loaded")
        self._watch: list[tuple[Monitor, int, int]] = []  # monitor, its layer, its index in a row
        for i, monitor in enumerate(monitors):
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

    def __bool__(self) -> bool:
        return bool(self._watch)

    def step(self, position: int, row: Sequence[float]) -> tuple[MonitorEvent, ...]:
        """The events at one generated token, in monitor order; a `stop` among them ends the generation."""
        assert self._calibration is not None
        events = []
        for i, (monitor, layer, index) in enumerate(self._watch):
            p = self._calibration.probability(row, index)
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
                    )
                )
        return tuple(events)
