"""The sparse autoencoders a server encodes with, as requests name them: their features to read
(engine/rows.feature_plan) and to steer along (engine/feature_steering.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from salience.errors import InvalidArgument

if TYPE_CHECKING:
    from salience.core.features.sae import SparseAutoencoder

__all__ = ["ServedSAE", "pick_sae"]


@dataclass(frozen=True, eq=False)
class ServedSAE:
    """An SAE the taps encode with: its slot in the feature buffer and how many features per token
    the graph keeps (`top`: what a request may ask for at most)."""

    sae: SparseAutoencoder
    slot: int
    top: int

    @property
    def name(self) -> str:
        return self.sae.name

    @property
    def layer(self) -> int:
        return self.sae.layer

    @property
    def info(self) -> dict:
        return {**self.sae.info(), "top": self.top}


def pick_sae(saes: Sequence[ServedSAE], name: str | None, where: str) -> ServedSAE:
    """The SAE `name` names (None or "": the only one served). Its errors say `where` in their
    message but name no field: the caller knows the field (`under`)."""
    if not saes:
        raise InvalidArgument(f"{where}: this server serves no sparse autoencoder (--sae)")
    if not name:
        if len(saes) > 1:
            raise InvalidArgument(f"{where}: name the SAE, one of {', '.join(s.name for s in saes)}")
        return saes[0]
    for served in saes:
        if served.name == name:
            return served
    raise InvalidArgument(f"{where}: unknown SAE {name!r}; served: {', '.join(s.name for s in saes) or 'none'}")
