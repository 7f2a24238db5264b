"""LMTP messages as typed values: one frozen dataclass per client message type.

Server-to-client frames are lists of JSON objects (`TOKEN [...]`, `MSG [...]`);
they are plain dicts built by the session, since their shape is fixed by what
LMQL reads (see docs/lmtp.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from salience.core.engine.chat_messages import ChatMessage
from salience.core.engine.requests import Constraint, FeatureRequest, ImageBlock, ResidualRequest
from salience.core.probes.monitors import Monitor
from salience.core.probes.patching import Patch
from salience.core.probes.steering import Intervention

__all__ = [
    "Cancel",
    "ClientMessage",
    "CloseSession",
    "DefineConcept",
    "DeleteConcept",
    "Detokenize",
    "DumpSession",
    "ForkSession",
    "Generate",
    "ImageInfo",
    "ModelInfo",
    "OpenSession",
    "PatchSweep",
    "SaveConcepts",
    "Score",
    "SessionGenerate",
    "Status",
    "Tokenize",
]


def _empty() -> Mapping[int, float]:
    return MappingProxyType({})


@dataclass(frozen=True, kw_only=True)
class Generate:
    """A prompt as token ids, or as chat `messages` the model's chat template renders (one of the two)."""

    stream_id: int
    prompt: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] | None = None
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=_empty)
    top_logprobs: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0  # accepted for LMQL; without beam search it has no effect (as in HF)
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    ignore_eos: bool = False
    text: bool = False
    readout: tuple[tuple[int, int], ...] = ()
    request_id: str | None = None  # the client's id for the stream (default: the server makes one)
    steer: tuple[Intervention, ...] = ()  # interventions on the residual stream (docs/steering.md)
    readout_format: str = "raw"  # or a probability view: "running", "token" (calibration.ReadoutView)
    readout_encoding: str = "json"  # or "f32": base64 of little-endian float32, as residual rows
    monitors: tuple[Monitor, ...] = ()  # watched on every generated token (docs/readouts.md#monitors)
    residual: ResidualRequest | None = None  # raw residual rows at these layers and positions
    patch: tuple[Patch, ...] = ()  # activations replaced (docs/patching.md)
    features: FeatureRequest | None = None  # an SAE's top features at these positions
    structured_outputs: Constraint | None = None  # what the text must match (docs/lmtp.md)


@dataclass(frozen=True, kw_only=True)
class Score:
    """As Generate, `prompt` or `messages`; `scored` follows the prompt (with messages: the reply)."""

    stream_id: int
    scored: tuple[int, ...]
    prompt: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] | None = None
    model: str | None = None
    top_logprobs: int = 0
    text: bool = False
    readout: tuple[tuple[int, int], ...] = ()
    request_id: str | None = None
    steer: tuple[Intervention, ...] = ()
    readout_format: str = "raw"
    readout_encoding: str = "json"  # or "f32": base64 of little-endian float32, as residual rows
    residual: ResidualRequest | None = None
    patch: tuple[Patch, ...] = ()
    features: FeatureRequest | None = None


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    stream_id: int | None = None
    model: str | None = None


@dataclass(frozen=True, kw_only=True)
class Cancel:
    stream_id: int


@dataclass(frozen=True, kw_only=True)
class Status:
    """Ask for the server's state and be told of every change (loading, ready, stopping)."""

    stream_id: int


@dataclass(frozen=True, kw_only=True)
class Tokenize:
    stream_id: int
    text: str
    add_special_tokens: bool = False


@dataclass(frozen=True, kw_only=True)
class Detokenize:
    stream_id: int
    tokens: tuple[int, ...]


# ---- live concepts (docs/live-concepts.md) ------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DefineConcept:
    """Examples to fit (`positive`, `negative`), or vectors to use as given: `vector` for every
    read layer, or `vectors` per read layer (float32 bytes)."""

    stream_id: int
    name: str
    positive: tuple[str, ...] = ()
    negative: tuple[str, ...] = ()
    method: str = "auto"
    layers: tuple[int, ...] | None = None
    vector: bytes | None = None
    vectors: Mapping[int, bytes] | None = None


@dataclass(frozen=True, kw_only=True)
class DeleteConcept:
    stream_id: int
    name: str


@dataclass(frozen=True, kw_only=True)
class SaveConcepts:
    stream_id: int


# ---- causal tracing (docs/patching.md) -----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class PatchSweep:
    """A causal-tracing sweep (core/serving/patch_sweep.Sweep): answered by progress messages,
    then the grid; CANCEL ends it."""

    stream_id: int
    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: tuple[int, ...]
    foil: tuple[int, ...] = ()
    points: tuple[str, ...] = ("resid_pre",)
    layers: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    metric: str = "logprob"


# ---- sessions: the same core sessions the gRPC service drives (docs/lmtp.md) ----------


@dataclass(frozen=True, kw_only=True)
class OpenSession:
    stream_id: int
    model: str | None = None


@dataclass(frozen=True, kw_only=True)
class CloseSession:
    stream_id: int
    session_id: str


@dataclass(frozen=True, kw_only=True)
class ForkSession:
    stream_id: int
    session_id: str
    at_position: int


@dataclass(frozen=True, kw_only=True)
class DumpSession:
    stream_id: int
    session_id: str


@dataclass(frozen=True, kw_only=True)
class SessionGenerate:
    """Append to a session (after an optional rewind), then decode; max_tokens 0 only scores."""

    stream_id: int
    session_id: str
    offset: int
    truncating: bool = False
    append: tuple[int, ...] = ()
    max_tokens: int = 0
    logprobs: tuple[tuple[int, int], ...] = ()
    top_logprobs: int = 0
    readout: tuple[tuple[int, int], ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    text: bool = False
    images: tuple[ImageBlock, ...] = ()
    request_id: str | None = None
    steer: tuple[Intervention, ...] = ()
    readout_format: str = "raw"
    readout_encoding: str = "json"  # or "f32": base64 of little-endian float32, as residual rows
    monitors: tuple[Monitor, ...] = ()
    residual: ResidualRequest | None = None
    patch: tuple[Patch, ...] = ()
    features: FeatureRequest | None = None
    structured_outputs: Constraint | None = None


@dataclass(frozen=True, kw_only=True)
class ImageInfo:
    """How many pads the model's vision block for this image holds (and its grid)."""

    stream_id: int
    data: bytes
    mime: str


SessionMessage = OpenSession | CloseSession | ForkSession | DumpSession
ClientMessage = (
    Generate
    | Score
    | ModelInfo
    | Cancel
    | Status
    | Tokenize
    | Detokenize
    | SessionMessage
    | SessionGenerate
    | ImageInfo
    | DefineConcept
    | DeleteConcept
    | SaveConcepts
    | PatchSweep
)
