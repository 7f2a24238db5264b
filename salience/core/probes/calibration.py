"""Readout rows as probabilities: the calibration a concept set publishes, applied per view.

A calibrated concept set publishes, per concept and read layer, the logistic maps the builder
fitted (probes/fitting.py), one per view of a readout (`ReadoutView`):
- `token`: p = 1 / (1 + exp(-(scale * raw + offset))), the token's own readout;
- `running`: the same with `running_scale` and `running_offset`, applied to the mean raw readout
  over the positions the request has read so far: p that the text so far has the concept.
Position 0 (the first token, where every model parks its massive activations) is never read as
a probability, nor counted in a running mean: both views give it None. `Calibration` applies
the maps to whole readout rows (layer-major, as they stream), in float64.

Pure Python on rows the engine already has, so the module stays importable without torch or
numpy (monitors.py, which clients import to parse monitors, builds on it).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from salience.errors import InvalidArgument

__all__ = ["VIEW_NAMES", "Calibration", "Presenter", "ReadoutView", "calibrated"]


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


# The views' names on every wire (LMTP's readout_format, the OpenAI extension's format), the old
# name of `token` last.
VIEW_NAMES = ("raw", "running", "token", "probability")


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
