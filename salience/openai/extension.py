"""The `salience` object of an OpenAI request (`extra_body` in the SDK): what it asks of the engine.

    "salience": {
      "readouts": {"format": "raw" | "probability", "over": "prompt" | "completion" | "all"},
      "features": {"k": 8, "sae": "name", "over": "prompt" | "completion" | "all"},
      "monitors": [{"concept": "code", "above": 0.9, "action": "stop"}, ...],
      "steer": [{"direction": "french", "layers": 15, "value": 8}, ...],
      "patch": [{"point": "resid_pre", "layer": 3, "positions": [4], "rows": "base64"}, ...],
      "logprobs": "raw" | "processed"
    }

Every part is optional, and so is the object: without it a request is a plain OpenAI request.
`monitors`, `steer` and `patch` are LMTP's, read by the core's own parsers (monitors.parse_monitors,
steering_json.parse_interventions, patching.parse_patches) so their rules live once (a patch's
positions are absolute, in the prompt as rendered: the completions API's own tokens); `readouts` and `features` name
spans of the request (`over`) instead of LMTP's absolute position ranges, which a chat client
cannot know before the template is rendered. What depends on the served concepts and SAEs
(names, layers, k) is the engine's check, as for LMTP. See responses.py for what comes back.

`logprobs` says which distribution the response's logprobs describe: `raw`, the model's own
(vLLM's raw_logprobs, what OpenAI's API reports), or `processed`, the one each token was drawn
from (LMTP's rule). By default raw when sampling, and at temperature 0 the distribution whose
argmax was taken, at temperature 1 (`processed`, which is the raw one unless penalties, a bias
or a mask change it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from salience.core.engine.requests import FeatureRequest, Probes
from salience.core.probes.calibration import VIEW_NAMES, ReadoutView
from salience.core.probes.monitors import Monitor, parse_monitors
from salience.core.probes.patching import Patch, parse_patches
from salience.core.probes.steering import Intervention
from salience.core.probes.steering_json import parse_interventions
from salience.openai.errors import bad_request, naming

__all__ = ["FORMATS", "LOGPROBS", "SPANS", "Extension", "Features", "Readouts", "parse_extension"]

FORMATS = VIEW_NAMES  # what a readout value is: core's views, as LMTP's readout_format
SPANS = ("prompt", "completion", "all")
LOGPROBS = ("raw", "processed")  # which distribution logprobs describe
_FIELDS = ("readouts", "features", "monitors", "steer", "patch", "logprobs")


@dataclass(frozen=True, kw_only=True)
class Readouts:
    format: str = "raw"
    over: str = "completion"


@dataclass(frozen=True, kw_only=True)
class Features:
    k: int
    sae: str | None = None  # None: the only SAE served
    over: str = "completion"


@dataclass(frozen=True, kw_only=True)
class Extension:
    readouts: Readouts | None = None
    features: Features | None = None
    monitors: tuple[Monitor, ...] = ()
    steer: tuple[Intervention, ...] = ()
    patch: tuple[Patch, ...] = ()
    logprobs: str | None = None  # one of LOGPROBS; None: raw when sampling, processed when greedy

    def raw_logprobs(self, temperature: float) -> bool:
        """Whether a request at `temperature` asks the engine for raw logprobs."""
        return self.logprobs == "raw" if self.logprobs is not None else temperature > 0

    def probes(self, prompt_len: int = 0, max_tokens: int = 0) -> Probes:
        """What the extension asks of the engine for a prompt of `prompt_len` tokens (by default
        where nothing falls, for what it asks regardless: its scopes)."""
        readouts, features = self.readouts, self.features
        return Probes(
            readout_ranges=(_span(readouts.over, prompt_len, max_tokens),) if readouts else (),
            readout_view=ReadoutView.named(readouts.format if readouts else "raw"),
            features=FeatureRequest(
                sae=features.sae, k=features.k, ranges=(_span(features.over, prompt_len, max_tokens),)
            )
            if features
            else None,
            monitors=self.monitors,
            steer=self.steer,
            patch=self.patch,
        )

    @property
    def per_token(self) -> bool:
        """Whether each completion token carries an entry (`salience.tokens`, beside logprobs)."""
        covered = [part.over for part in (self.readouts, self.features) if part is not None]
        return bool(self.monitors) or any(over != "prompt" for over in covered)


def _span(over: str, prompt_len: int, max_tokens: int) -> tuple[int, int]:
    end = prompt_len + max_tokens
    return {"prompt": (0, prompt_len), "completion": (prompt_len, end), "all": (0, end)}[over]


def parse_extension(value: Any, name: str = "salience") -> Extension:
    """The object's parts, or a 400 naming the field at fault (`salience.monitors`, ...)."""
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object with any of {', '.join(_FIELDS)}", name)
    unknown = sorted(set(value) - set(_FIELDS))
    if unknown:
        listed = ", ".join(unknown)
        raise bad_request(f"{name}: unknown field(s) {listed}; known: {', '.join(_FIELDS)}", f"{name}.{unknown[0]}")
    parts: dict[str, Any] = {}
    if value.get("readouts") is not None:
        parts["readouts"] = _readouts(value["readouts"], f"{name}.readouts")
    if value.get("features") is not None:
        parts["features"] = _features(value["features"], f"{name}.features")
    if value.get("monitors") is not None:
        with naming(f"{name}.monitors", fields={}):  # the list is the param, not a monitor's field
            parts["monitors"] = parse_monitors(value["monitors"])
    if value.get("steer") is not None:
        with naming(f"{name}.steer", fields={"steer": name}):
            parts["steer"] = parse_interventions(value["steer"])
    if value.get("patch") is not None:
        with naming(f"{name}.patch", fields={"patch": name}):
            parts["patch"] = parse_patches(value["patch"])
    if value.get("logprobs") is not None:
        parts["logprobs"] = _choice(value, "logprobs", LOGPROBS, "raw", name)
    return Extension(**parts)


def _choice(part: dict, key: str, options: tuple[str, ...], default: str, where: str) -> str:
    chosen = part.get(key, default)
    if chosen not in options:
        raise bad_request(f"{where}.{key} must be one of {', '.join(options)}, got {chosen!r}", f"{where}.{key}")
    return chosen


def _readouts(value: Any, where: str) -> Readouts:
    if not isinstance(value, dict) or set(value) - {"format", "over"}:
        raise bad_request(f'{where} must be {{"format": {" | ".join(FORMATS)}, "over": {" | ".join(SPANS)}}}', where)
    return Readouts(
        format=_choice(value, "format", FORMATS, "raw", where), over=_choice(value, "over", SPANS, "completion", where)
    )


def _features(value: Any, where: str) -> Features:
    if not isinstance(value, dict) or set(value) - {"k", "sae", "over"} or "k" not in value:
        raise bad_request(f'{where} must be {{"k": K, "sae"?: NAME, "over"?: {" | ".join(SPANS)}}}', where)
    k, sae = value["k"], value.get("sae")
    if type(k) is not int or k < 1:
        raise bad_request(f"{where}.k must be an integer >= 1, got {k!r}", f"{where}.k")
    if sae is not None and not isinstance(sae, str):
        raise bad_request(f"{where}.sae must name an SAE", f"{where}.sae")
    return Features(k=k, sae=sae, over=_choice(value, "over", SPANS, "completion", where))
