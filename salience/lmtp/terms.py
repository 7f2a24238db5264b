"""LMTP's messages in core's terms and back: what a stream asks of the model (Probes), the
scopes a message needs, and core's field names as LMTP spells them in an error."""

from __future__ import annotations

from salience.core.engine.requests import Probes
from salience.core.probes.calibration import ReadoutView
from salience.errors import renamed
from salience.lmtp.fields import TYPES
from salience.lmtp.messages import ClientMessage, Generate, Score, SessionGenerate
from salience.scopes import asked, needs

__all__ = ["probes_of", "scopes_of", "wire_field"]

_NAMES = {cls: name for name, (cls, _, _) in TYPES.items()}

# Core's names that LMTP spells otherwise, for an error's field (`readout_ranges[1]` is `readout[1]`).
_WIRE_NAMES = {
    "readout_ranges": "readout",
    "readout_view": "readout_format",
    "logprobs_ranges": "logprobs",
    "logprobs": "top_logprobs",
    "continuation": "scored",
    "append_tokens": "append",
}


def probes_of(message: Generate | Score | SessionGenerate) -> Probes:
    """What a stream's message asks of the model besides its prompt and sampling, as core takes it
    (a SCORE has no monitors)."""
    return Probes(
        readout_ranges=message.readout,
        readout_view=ReadoutView.named(message.readout_format),
        steer=message.steer,
        monitors=getattr(message, "monitors", ()),
        residual=message.residual,
        features=message.features,
        patch=message.patch,
    )


def scopes_of(message: ClientMessage) -> tuple[str, ...]:
    """What the message needs: its type's scopes, and those a stream's fields ask for."""
    own = needs(f"LMTP {_NAMES[type(message)]}")
    if not isinstance(message, Generate | Score | SessionGenerate):
        return own
    return own + asked(probes_of(message))


def wire_field(field: str | None) -> str | None:
    """A core error's field as LMTP names it."""
    return renamed(field, _WIRE_NAMES)
