"""What one choice's generation read, as the `salience` extension reports it.

Per completion token, an entry in the order of logprobs' content: `position`, and where the
request asked for them its `readout` row (layer-major, as LMTP's), its top `features` and the
`monitors` that fired on it. Per prompt position the request covered, the same with the token.
At the choice's end, a summary per calibrated concept at its recommended layer: `running`, p
that the completion has the concept (the running view at its last token read), then the
token view's mean and largest over the completion and the token where the largest is; and,
when a `stop` monitor ended the choice, which monitor, concept and token.

The summary's probabilities come from the readout rows through the concept set's calibration
(probes/calibration.py), whichever format the client asked the rows in, where that format
holds them: rows in the running view carry no token view (the summary then has `running` only),
rows in the token view no running mean (`running` is left out).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from salience.core.engine.requests import TokenEvent
from salience.core.probes.calibration import Calibration, MonitorEvent, ReadoutView
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
    """One concept's token-view mean and maximum over the completion, and what its running p needs:
    the sum of its raw values (raw rows), or the last running p (running rows)."""

    __slots__ = ("at", "count", "max", "raw", "running", "total")

    def __init__(self) -> None:
        self.total, self.count, self.max, self.at = 0.0, 0, -1.0, (0, 0, 0)
        self.raw = 0.0  # over the `count` tokens read, for raw rows
        self.running: float | None = None

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
        self._format = ReadoutView.named(extension.readouts.format) if extension.readouts else ReadoutView.RAW
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
            self._read(row, (index, event.position, event.token_id))
        if event.features is not None:
            entry["features"] = [list(pair) for pair in event.features]
        if event.monitors:
            entry["monitors"] = [fired.as_dict() for fired in event.monitors]
        return entry

    def _read(self, row: Sequence, at: tuple[int, int, int]) -> None:
        calibration = self._calibration
        for concept, _, column in self._watch:
            peak = self._peaks[concept]
            if self._format is ReadoutView.RUNNING:
                peak.running = row[column] if row[column] is not None else peak.running
                continue
            if self._format is ReadoutView.RAW:
                peak.raw += row[column]
            p = (
                row[column]
                if self._format is ReadoutView.TOKEN or calibration is None
                else calibration.probability(row, column)
            )
            if p is not None:
                peak.add(p, at)

    def summary(self) -> dict | None:
        """Per concept read over the completion: mean and max probability, and where the max is."""
        if not self._watch:
            return None
        out = {}
        for concept, layer, column in self._watch:
            peak = self._peaks[concept]
            entry: dict[str, Any] = {"layer": layer}
            raw = self._format is ReadoutView.RAW and peak.count
            if raw and self._calibration is not None and self._calibration.running_scale:
                entry["running"] = self._calibration.running_probability(peak.raw / peak.count, column)
            elif peak.running is not None:
                entry["running"] = peak.running
            if peak.count:
                index, position, token = peak.at
                entry["mean"] = peak.total / peak.count
                entry["max"] = peak.max
                entry["max_at"] = {"index": index, "position": position, "token": self._pieces.text(token)}
            if len(entry) > 1:
                out[concept] = entry
        return out

    def stopped_by(self, monitor: MonitorEvent, index: int, token_id: int) -> dict:
        """The monitor that ended the choice, and the token it held on."""
        return {**monitor.as_dict(), "index": index, "token": self._pieces.text(token_id)}
