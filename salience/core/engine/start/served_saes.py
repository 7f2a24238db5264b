"""The served SAEs: each one's slot in the feature buffer and how many features per token its tap
keeps. The tap config (what the graph is built with) and the engine (what requests may ask for)
read the same numbers from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from salience.core.engine.settings import EngineSettings
from salience.core.features.served import ServedSAE

if TYPE_CHECKING:
    from salience.core.features.sae import SparseAutoencoder

__all__ = ["sae_top", "served_saes"]


def served_saes(settings: EngineSettings) -> list[ServedSAE]:
    """The SAEs the taps encode with, in their buffer slots' order."""
    return [ServedSAE(sae, slot, sae_top(sae, settings)) for slot, sae in enumerate(settings.saes)]


def sae_top(sae: SparseAutoencoder, settings: EngineSettings) -> int:
    """Features per token the graph keeps of `sae`: `--sae-top`, no more than a top-k SAE's k."""
    return min(settings.sae_top, sae.k or sae.d_sae, sae.d_sae)
