"""What one choice's generation read, as the `salience` extension reports it.

Per completion token, an entry in the order of logprobs' content: `position`, and where the
request asked for them its `readout` row (layer-major, as LMTP's), its top `features` and the
`monitors` that fired on it. Per prompt position the request covered, the same with the token.
At the choice's end, a summary per calibrated concept at its recommended layer: `running`, p
that the completion has the concept (the running view at its last token read), then the
token view's mean and largest over the completion and the token where the largest is; and,
when a `stop` monitor ended the choice, which monitor, concept and token. When the reply is
constrained to JSON, the same figures per JSON leaf (`fields`): over the tokens holding the
value's characters (core/probes/json_fields.py), `running` at the value's last token. When the
reply calls tools, the same per call instead (`tool_calls`: each call's `index` and the `fields`
of its arguments, paths from the arguments object: `$.city`).

The summary's probabilities come from the readout rows through the concept set's calibration
(probes/calibration.py), whichever format the client asked the rows in, where that format
holds them: rows in the running view carry no token view (the summary then has `running` only),
rows in the token view no running mean (`running` is left out).
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from salience.core.engine.requests import TokenEvent
from salience.core.probes.calibration import Calibration, ReadoutView
from salience.core.probes.json_fields import Leaf, Span, leaves, spans
from salience.core.probes.live import ConceptView
from salience.core.probes.monitors import MonitorEvent
from salience.errors import InvalidArgument
from salience.openai.extension import Extension
from salience.openai.tokens import TokenText

__all__ = ["Readings", "layout"]


def _leaves(text: str, at: tuple[int, int]) -> list[Leaf]:
    """The leaves of the JSON object at `text[start:end]`, their characters counted in `text`."""
    start, end = at
    return [replace(leaf, start=leaf.start + start, end=leaf.end + start) for leaf in leaves(text[start:end])]


def layout(extension: Extension | None, view: ConceptView | None) -> dict | None:
    """What a readout row holds (the response's top-level `salience`), when rows were asked for."""
    if extension is None or extension.readouts is None or view is None:
        return None
    return {"concepts": list(view.concepts), "layers": list(view.layers), "format": extension.readouts.format}


class _Series:
    """One concept's figures at each completion token read: its token-view p (None where the rows
    hold none), and what its running p needs there: the running sum of its raw values (raw rows),
    or the last running p (running rows)."""

    __slots__ = ("p", "raw", "running")

    def __init__(self) -> None:
        self.p: list[float | None] = []
        self.raw: list[float] = []
        self.running: list[float | None] = []


class Readings:
    """One choice's extension output, built token by token."""

    def __init__(
        self, extension: Extension, view: ConceptView | None, pieces: TokenText, *, fields: bool = False
    ) -> None:
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
        self._series = {concept: _Series() for concept, _, _ in self._watch}
        self._read_at: list[tuple[int, int, int]] = []  # (index, position, token id) of each token read
        # Each completion token's text, when the reply is JSON whose leaves get figures of their own.
        self._texts: list[str] | None = [] if fields and self._watch else None

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

    def token(self, event: TokenEvent, index: int, text: str) -> dict:
        """The entry of the completion's `index`-th token, whose `text` is what it adds to the reply."""
        entry: dict[str, Any] = {"position": event.position}
        row = event.readout
        if row is not None:
            entry["readout"] = row
            self._read(row, (index, event.position, event.token_id))
        if event.features is not None:
            entry["features"] = [list(pair) for pair in event.features]
        if event.monitors:
            entry["monitors"] = [fired.as_dict() for fired in event.monitors]
        if self._texts is not None:
            self._texts.append(text)
        return entry

    def _read(self, row: Sequence, at: tuple[int, int, int]) -> None:
        self._read_at.append(at)
        calibration = self._calibration
        for concept, _, column in self._watch:
            series, value = self._series[concept], row[column]
            if self._format is ReadoutView.RUNNING:
                series.running.append(value if value is not None else (series.running or [None])[-1])
                continue
            if self._format is ReadoutView.RAW:
                series.raw.append((series.raw[-1] if series.raw else 0.0) + value)
            assert calibration is not None  # concepts are watched only with one
            series.p.append(value if self._format is ReadoutView.TOKEN else calibration.probability(row, column))

    def end(self, calls: Sequence[tuple[int, int] | None] | None = None) -> dict | None:
        """The choice's `summary` over the completion, and with a JSON reply its `fields`; with
        `calls` (where each tool call's arguments lie in the reply's text) each call's `fields`."""
        if not self._watch:
            return None
        end: dict[str, Any] = {"summary": self._figures(0, len(self._read_at))}
        if self._texts is not None:
            indexes = [at[0] for at in self._read_at]
            text = "".join(self._texts)
            if calls is None:
                end["fields"] = [self._field(span, indexes) for span in spans(leaves(text), self._texts)]
            else:
                end["tool_calls"] = [
                    {"index": i, "fields": [self._field(s, indexes) for s in spans(_leaves(text, at), self._texts)]}
                    for i, at in enumerate(calls)
                    if at is not None
                ]
        return end

    def _field(self, span: Span, indexes: Sequence[int]) -> dict:
        """A JSON leaf's path, characters and tokens, and the figures over its tokens read."""
        leaf = span.leaf
        field: dict[str, Any] = {"path": leaf.path, "chars": {"start": leaf.start, "end": leaf.end}}
        if span.first is not None and span.last is not None:
            field["tokens"] = {"first": span.first, "last": span.last}
            field["concepts"] = self._figures(
                bisect.bisect_left(indexes, span.first), bisect.bisect_right(indexes, span.last)
            )
        return field

    def _figures(self, lo: int, hi: int) -> dict:
        """Per concept, over the tokens read `lo` to `hi` (exclusive, in reading order): the running p
        at the last of them, the token view's mean and largest, and where the largest is."""
        out = {}
        for concept, layer, column in self._watch:
            series = self._series[concept]
            entry: dict[str, Any] = {"layer": layer}
            if hi > lo and self._format is ReadoutView.RAW:
                calibration = self._calibration
                if calibration is not None and calibration.running_scale:  # the mean of raw values read so far
                    entry["running"] = calibration.running_probability(series.raw[hi - 1] / hi, column)
            elif hi > lo and self._format is ReadoutView.RUNNING and series.running[hi - 1] is not None:
                entry["running"] = series.running[hi - 1]
            read = [(p, k) for k, p in enumerate(series.p[lo:hi], lo) if p is not None]
            if read:
                peak, k = max(read, key=lambda pair: (pair[0], -pair[1]))  # the first of equal peaks
                index, position, token = self._read_at[k]
                entry["mean"] = sum(p for p, _ in read) / len(read)
                entry["max"] = peak
                entry["max_at"] = {"index": index, "position": position, "token": self._pieces.text(token)}
            if len(entry) > 1:
                out[concept] = entry
        return out

    def stopped_by(self, monitor: MonitorEvent, index: int, token_id: int) -> dict:
        """The monitor that ended the choice, and the token it held on."""
        return {**monitor.as_dict(), "index": index, "token": self._pieces.text(token_id)}
