"""What one choice's generation read, as the `salience` extension reports it.

Per completion token, an entry in the order of logprobs' content: `position`, and where the
request asked for them its `readout` row (layer-major, as LMTP's), its top `features` and the
`monitors` that fired on it. Per prompt position the request covered, the same with the token.
At the choice's end, a summary per calibrated concept at its recommended layer: the mean
probability over the completion tokens read, the largest and the token where it occurs; and,
when a `stop` monitor ended the choice, which monitor, concept and token.

Probabilities for the summary come from the readout rows through the concept set's calibration
(probes/calibration.py), whichever format the client asked the rows in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from salience.core.engine.requests import TokenEvent
from salience.core.probes.calibration import Calibration, MonitorEvent
from salience.core.probes.live import ConceptView
from salience.errors import InvalidArgument
from salience.openai.extension import Extension
from salience.openai.tokens import TokenText

__all__ = ["Readings", "layout"]


def layout(extension: Extension | None, view: ConceptView | None) -> dict | None:
    """What a readout row holds (the response's top-level `salience`), when rows were asked for."""
    if extension is None or extension.readouts is None or view is None:
        return None
    return {"concepts": list(view.concepts), "layers": list(view.layers), "format": extension.readouts.format}


class _Peak:
    """One concept's running mean and maximum over the completion."""

    __slots__ = ("at", "count", "max", "total")

    def __init__(self) -> None:
        self.total, self.count, self.max, self.at = 0.0, 0, -1.0, (0, 0, 0)

    def add(self, p: float, at: tuple[int, int, int]) -> None:
        self.total += p
        self.count += 1
        if p > self.max:
            self.max, self.at = p, at


class Readings:
    """One choice's extension output, built token by token."""

    def __init__(self, extension: Extension, view: ConceptView | None, pieces: TokenText) -> None:
        self._pieces = pieces
        self.per_token = extension.per_token  # whether each completion token gets an entry
        self._probabilities = extension.readouts is not None and extension.readouts.format == "probability"
        self._watch: list[tuple[str, int, int]] = []  # concept, layer, index in a row
        self._calibration: Calibration | None = None
        if view is not None and extension.readouts is not None and extension.readouts.over != "prompt":
            with contextlib.suppress(InvalidArgument):  # no calibrated concept: rows, but no summary
                self._calibration = view.calibration
        if self._calibration is not None:
            calibration = self._calibration
            for concept, layer in calibration.recommended.items():
                if layer in calibration.layers:
                    self._watch.append((concept, layer, calibration.index(concept, layer)))
        self._peaks = {concept: _Peak() for concept, _, _ in self._watch}

    def prompt(self, prompt: Sequence[int], readouts: Mapping[int, Any], rows: Mapping[str, Mapping]) -> list[dict]:
        """The covered prompt positions' entries, in order."""
        features = rows.get("features", {})
        entries = []
        for position in sorted(set(readouts) | set(features)):
            token = prompt[position]
            entry: dict[str, Any] = {"position": position, "token_id": token, "token": self._pieces.text(token)}
            if position in readouts:
                entry["readout"] = readouts[position]
            if position in features:
                entry["features"] = [list(pair) for pair in features[position]]
            entries.append(entry)
        return entries

    def token(self, event: TokenEvent, index: int) -> dict:
        """The entry of the completion's `index`-th token."""
        entry: dict[str, Any] = {"position": event.position}
        row = event.readout
        if row is not None:
            entry["readout"] = row
            calibration = self._calibration
            for concept, _, column in self._watch:
                p = row[column] if self._probabilities or calibration is None else calibration.probability(row, column)
                if p is not None:
                    self._peaks[concept].add(p, (index, event.position, event.token_id))
        if event.features is not None:
            entry["features"] = [list(pair) for pair in event.features]
        if event.monitors:
            entry["monitors"] = [fired.as_dict() for fired in event.monitors]
        return entry

    def summary(self) -> dict | None:
        """Per concept read over the completion: mean and max probability, and where the max is."""
        if not self._watch:
            return None
        out = {}
        for concept, layer, _ in self._watch:
            peak = self._peaks[concept]
            if peak.count:
                index, position, token = peak.at
                out[concept] = {
                    "layer": layer,
                    "mean": peak.total / peak.count,
                    "max": peak.max,
                    "max_at": {"index": index, "position": position, "token": self._pieces.text(token)},
                }
        return out

    def stopped_by(self, monitor: MonitorEvent, index: int, token_id: int) -> dict:
        """The monitor that ended the choice, and the token it held on."""
        return {**monitor.as_dict(), "index": index, "token": self._pieces.text(token_id)}
