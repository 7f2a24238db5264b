"""Monitors: they act on a concept's probability (or an SAE feature's activation) while text is
generated.

A monitor watches one concept at one layer on every generated token: `above: t` holds when
p > t, `below: t` when p < t. `stop` ends the generation at the first token where it holds;
`flag` reports each token where it starts to hold (it did not hold on the previous generated
token, or there was none). A monitor with a `path` (a JSONPath, json_fields.pattern) watches
one field of a JSON reply: it holds only on tokens whose text holds a character of a value at
or under that path (the one being written included: json_fields.Cursor, fed each token's text),
so a `stop` ends the reply inside that field and a `flag` fires where the field starts to hold.
Evaluation is pure Python on rows the engine already has, so the module stays importable
without torch or numpy: clients parse monitors with it.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from salience.core.features.served import ServedSAE, pick_sae
from salience.core.probes.calibration import Calibration
from salience.core.probes.json_fields import Cursor, pattern
from salience.errors import InvalidArgument, under

__all__ = ["MAX_MONITORS", "Action", "Monitor", "MonitorEvent", "MonitorState", "parse_monitors"]

MAX_MONITORS = 16  # per request


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
    path: str | None = None  # a JSONPath: it watches only that field of a JSON reply

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
    path: str | None = None

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
            **({"path": self.path} if self.path is not None else {}),
        }


def parse_monitors(items: Any) -> tuple[Monitor, ...]:
    """Monitors from their JSON form (LMTP's `monitors`), every field checked; InvalidArgument names it.
    Whether the concept and layer exist is the engine's check (MonitorState.start)."""
    if not isinstance(items, list):
        raise InvalidArgument(
            "monitors must be a list of {concept, above|below, action[, layer]} objects", field="monitors"
        )
    if len(items) > MAX_MONITORS:
        raise InvalidArgument(f"{len(items)} monitors asked for; at most {MAX_MONITORS} per request", field="monitors")
    monitors = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidArgument(f"monitor {i} must be an object", field=f"monitors[{i}]")
        unknown = set(item) - {"concept", "layer", "above", "below", "action", "feature", "sae", "path"}
        if unknown:
            raise InvalidArgument(f"monitor {i}: unknown field(s) {', '.join(sorted(unknown))}", field=f"monitors[{i}]")
        try:
            action = Action(item.get("action"))
        except ValueError:
            raise InvalidArgument(
                f"monitor {i}: 'action' must be 'flag' or 'stop', got {item.get('action')!r}",
                field=f"monitors[{i}].action",
            ) from None
        where = _path(i, item.get("path"))
        if "feature" in item or "sae" in item:
            monitors.append(_feature_monitor(i, item, action, where))
            continue
        concept = item.get("concept")
        if not isinstance(concept, str) or not concept:
            raise InvalidArgument(
                f"monitor {i}: 'concept' must name a concept (or give a feature)", field=f"monitors[{i}].concept"
            )
        layer = item.get("layer")
        if layer is not None and (type(layer) is not int or layer < 0):
            raise InvalidArgument(
                f"monitor {i}: 'layer' must be a layer index, got {layer!r}", field=f"monitors[{i}].layer"
            )
        monitors.append(
            Monitor(
                concept=concept,
                layer=layer,
                action=action,
                path=where,
                **_threshold(i, item.get("above"), item.get("below")),
            )
        )
    return tuple(monitors)


def _path(i: int, value: Any) -> str | None:
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise ValueError(f"a JSONPath is a string, got {value!r}")
        pattern(value)
    except ValueError as exc:
        raise InvalidArgument(f"monitor {i}: 'path': {exc}", field=f"monitors[{i}].path") from None
    return value


def _feature_monitor(i: int, item: dict, action: Action, path: str | None) -> Monitor:
    feature, sae = item.get("feature"), item.get("sae")
    if "concept" in item or "layer" in item:
        raise InvalidArgument(
            f"monitor {i}: a feature monitor watches its SAE's layer: give no concept or layer", field=f"monitors[{i}]"
        )
    if type(feature) is not int or feature < 0:
        raise InvalidArgument(
            f"monitor {i}: 'feature' must be a feature id (an integer >= 0), got {feature!r}",
            field=f"monitors[{i}].feature",
        )
    if sae is not None and not isinstance(sae, str):
        raise InvalidArgument(f"monitor {i}: 'sae' must name an SAE, got {sae!r}", field=f"monitors[{i}].sae")
    return Monitor(
        concept="",
        feature=feature,
        sae=sae,
        action=action,
        path=path,
        **_threshold(i, item.get("above"), item.get("below"), True),
    )


def _threshold(i: int, above: Any, below: Any, activation: bool = False) -> dict[str, float]:
    if (above is None) == (below is None):
        raise InvalidArgument(f"monitor {i}: give exactly one of 'above' and 'below'", field=f"monitors[{i}]")
    name, value = ("above", above) if above is not None else ("below", below)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"monitor {i}: '{name}' must be a number, got {value!r}", field=f"monitors[{i}].{name}")
    if activation:
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(
                f"monitor {i}: '{name}' must be an activation >= 0, got {value!r}", field=f"monitors[{i}].{name}"
            )
    elif not 0 < value < 1:
        raise InvalidArgument(
            f"monitor {i}: '{name}' must be a probability strictly between 0 and 1, got {value!r}",
            field=f"monitors[{i}].{name}",
        )
    return {name: float(value)}


class MonitorState:
    """A generation's monitors, checked against the served set and SAEs, stepping token by token.

    A feature monitor reads the feature's activation from the token's top features (the SAE's
    `top`, which the engine asks for on every generated token): exact for a top-k SAE, whose
    active features all fit; for another SAE, a feature active beyond its `top` reads 0.

    `text` gives each generated token's text (an incremental detokenizer's), needed when a
    monitor has a path: `step` is then given every generated token, in order."""

    def __init__(
        self,
        monitors: Sequence[Monitor],
        calibration: Calibration | None,
        saes: Sequence[ServedSAE] = (),
        text: Callable[[int], str] | None = None,
    ) -> None:
        concepts = [m for m in monitors if m.feature is None]
        if concepts and calibration is None:
            raise InvalidArgument(
                "monitors need concept readouts, and this server has no concept set loaded", field="monitors"
            )
        self._watch: list[tuple[Monitor, int, int]] = []  # monitor, its layer, its concept's index in a row
        self.sae: ServedSAE | None = None  # the SAE feature monitors watch (one per request)
        for i, monitor in enumerate(monitors):
            if monitor.feature is not None:
                self._watch.append((monitor, *self._feature(i, monitor, saes)))
                continue
            assert calibration is not None
            if monitor.concept not in calibration.concepts:
                raise InvalidArgument(
                    f"monitor {i}: unknown concept {monitor.concept!r}; known: {', '.join(calibration.concepts)}",
                    field=f"monitors[{i}].concept",
                )
            if monitor.concept not in calibration.recommended:
                raise InvalidArgument(
                    f"monitor {i}: concept {monitor.concept!r} has no calibration (it was given as raw vectors): "
                    "it cannot be monitored as a probability",
                    field=f"monitors[{i}].concept",
                )
            layer = calibration.recommended[monitor.concept] if monitor.layer is None else monitor.layer
            if layer not in calibration.layers:
                raise InvalidArgument(
                    f"monitor {i}: layer {layer} is not read; read layers are {calibration.layers[0]}.."
                    f"{calibration.layers[-1]} ({len(calibration.layers)} of them)",
                    field=f"monitors[{i}].layer",
                )
            self._watch.append((monitor, layer, calibration.index(monitor.concept, layer)))
        self._calibration = calibration
        self._held = [False] * len(self._watch)
        self._scopes = [pattern(m.path) if m.path is not None else None for m, _, _ in self._watch]
        self._text = text
        self._cursor = Cursor() if any(self._scopes) else None
        if self._cursor is not None and text is None:
            raise ValueError("a monitor with a path needs each token's text")

    def _feature(self, i: int, monitor: Monitor, saes: Sequence[ServedSAE]) -> tuple[int, int]:
        with under(f"monitors[{i}]"):
            served = pick_sae(saes, monitor.sae, f"monitor {i}")
        if self.sae is not None and served is not self.sae:
            raise InvalidArgument(
                f"monitor {i}: one request's feature monitors watch one SAE, here {self.sae.name!r}",
                field=f"monitors[{i}]",
            )
        if not 0 <= monitor.feature < served.sae.d_sae:  # type: ignore[operator]
            raise InvalidArgument(
                f"monitor {i}: feature {monitor.feature} is outside SAE {served.name!r}", field=f"monitors[{i}].feature"
            )
        self.sae = served
        return served.layer, -1

    @property
    def concepts(self) -> bool:
        """Whether any monitor watches a concept (and needs every generated token's readouts)."""
        return any(m.feature is None for m, _, _ in self._watch)

    def __bool__(self) -> bool:
        return bool(self._watch)

    def step(
        self,
        position: int,
        row: Sequence[float] | None,
        features: Sequence[tuple[int, float]] | None = None,
        token: int = -1,
    ) -> tuple[MonitorEvent, ...]:
        """The events at one generated token, in monitor order; a `stop` among them ends the
        generation. `row`: its readouts; `features`: its top features of the watched SAE; `token`:
        its id (read only with a path)."""
        events = []
        active = dict(features or ())
        where = self._cursor.feed(self._text(token)) if self._cursor is not None else ()  # type: ignore[misc]
        for i, (monitor, layer, index) in enumerate(self._watch):
            scope = self._scopes[i]
            if scope is not None and not any(scope.match(leaf) for leaf in where):
                self._held[i] = False  # outside its field: it holds on none of these tokens
                continue
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
                        path=monitor.path,
                    )
                )
        return tuple(events)
