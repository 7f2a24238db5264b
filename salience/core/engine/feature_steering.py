"""Steering along SAE features: a feature's decoder row, as a request vector."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from salience.core.features.served import ServedSAE, pick_sae
from salience.core.probes.steering import Intervention
from salience.errors import InvalidArgument, under

__all__ = ["resolve_features"]


def resolve_features(steer: Sequence[Intervention], saes: Sequence[ServedSAE]) -> tuple[Intervention, ...]:
    """Interventions along SAE features as request vectors: the feature's decoder row, at the SAE's
    layer unless the intervention names layers (steering normalises every direction to unit
    length, so `value` is in the residual's own units, as for any direction)."""
    out = []
    for n, intervention in enumerate(steer):
        if intervention.feature is None:
            out.append(intervention)
            continue
        where = f"steer[{n}]"
        if intervention.direction or intervention.vector is not None:
            raise InvalidArgument(f"{where}: give one of direction, vector and feature", field=where)
        name, feature = intervention.feature
        with under(where):
            served = pick_sae(saes, name, where)
        if not 0 <= feature < served.sae.d_sae:
            raise InvalidArgument(
                f"{where}: feature {feature} is outside SAE {served.name!r} (0..{served.sae.d_sae - 1})", field=where
            )
        row = served.sae.W_dec[feature].numpy().astype(np.float32, copy=False)
        out.append(
            dataclasses.replace(
                intervention,
                feature=None,
                vector=row.tobytes(),
                layers=intervention.layers or (served.layer,),
            )
        )
    return tuple(out)
