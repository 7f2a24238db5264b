"""The reference for steering: the same interventions applied to transformers by forward hooks.

Independent of the serving code: positions, layers and coefficients are taken from the
interventions as a client states them, and applied in float64 to each hooked layer's output
(the residual stream before the final norm), every intervention at a layer computed from the
residual before any of them and summed, as docs/steering.md defines. A cap adds
(clamp(<h, d>, lo, hi) - <h, d>) d; a request's own vector is its direction at every layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from salience.core.probes.concepts import ConceptSet
from salience.core.probes.steering import Intervention, Op


def unit(sets: Sequence[ConceptSet], name: str, layer: int) -> torch.Tensor:
    for concept_set in sets:
        if name in concept_set.concepts:
            v = concept_set.vectors[layer][concept_set.concepts.index(name)].double()
            return v / v.norm()
    raise KeyError(name)


def positions(intervention: Intervention, prompt_len: int, total: int) -> torch.Tensor:
    """Which of `total` positions the intervention covers, as a bool mask."""
    mask = torch.zeros(total, dtype=torch.bool)
    if intervention.prompt:
        mask[:prompt_len] = True
    if intervention.generated:
        mask[prompt_len:] = True
    for start, end in intervention.ranges:
        mask[start:end] = True
    return mask


@contextlib.contextmanager
def steered(model, sets: Sequence[ConceptSet], steer: Sequence[Intervention], prompt_len: int) -> Iterator[None]:
    """While active, every forward of `model` (transformers, batch 1, whole sequence) is steered."""
    by_layer: dict[int, list[Intervention]] = {}
    for intervention in steer:
        for layer in intervention.layers:
            by_layer.setdefault(layer, []).append(intervention)

    def hook(module, args, output, layer: int):
        hidden = output[0] if isinstance(output, tuple) else output
        h = hidden[0].double()  # [positions, hidden]
        delta = torch.zeros_like(h)
        for i in by_layer[layer]:
            if i.vector is not None:
                d = torch.from_numpy(np.frombuffer(i.vector, dtype=np.float32).copy()).double()
                d = d / d.norm()
            else:
                d = unit(sets, i.direction, layer)
            mask = positions(i, prompt_len, h.shape[0]).double()[:, None]
            p = h @ d
            if i.op is Op.CAP:
                lo = -torch.inf if i.lo is None else i.lo
                hi = torch.inf if i.hi is None else i.hi
                change = p.clamp(lo, hi) - p
            else:
                a, b = {Op.ADD: (i.value, 0.0), Op.SET: (i.value, -1.0), Op.ABLATE: (0.0, -1.0)}[i.op]
                change = a + b * p
            delta += mask * change[:, None] * d[None, :]
        new = (h + delta).to(hidden.dtype)[None]
        return (new, *output[1:]) if isinstance(output, tuple) else new

    layers = model.model.layers
    handles = [
        layers[layer].register_forward_hook(lambda m, a, o, layer=layer: hook(m, a, o, layer)) for layer in by_layer
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
