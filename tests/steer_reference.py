"""The reference for steering: the same interventions applied to transformers by forward hooks.

Independent of the serving code: positions, layers and coefficients are taken from the
interventions as a client states them, and applied in float64 to the stream at the sets' point
of each hooked layer (resid_post: its output, before the final norm), every intervention at a layer computed from the
residual before any of them and summed, as docs/steering.md defines. A cap adds
(clamp(<h, d>, lo, hi) - <h, d>) d; a request's own vector is its direction at every layer.
`check_against_reference` holds a steered generation to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch

from salience.core.engine.generation import Generation
from salience.core.engine.requests import SamplingOptions, TokenEvent
from salience.core.models.points import Site
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.steering import Intervention, Op
from tests.reference import (
    Reference,
    assert_logprobs_match,
    assert_readouts_close,
    decoder_layers,
    hook_site,
    passed_on,
    reference_readouts,
)


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

    def change(hidden: torch.Tensor, layer: int) -> torch.Tensor | None:
        """The steered stream, passed on (reference.passed_on)."""
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
        return passed_on(point, hidden, (h + delta).to(hidden.dtype)[None])

    layers, point = decoder_layers(model), sets[0].point
    handles = [
        hook_site(model, layers, Site(layer, point), lambda hidden, layer=layer: change(hidden, layer))
        for layer in by_layer
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def check_against_reference(
    reference: Reference,
    concepts: ConceptSet,
    prompt: list[int],
    interventions: Sequence[Intervention],
    options: SamplingOptions,
    generation: Generation,
    events: list[TokenEvent],
    steering_set: ConceptSet | None = None,
) -> list[int]:
    """A greedy generation of `options` (ignore_eos, no stop: exactly max_tokens), asked for prompt
    logprobs and readouts at every position: its tokens, logprobs (the prompt's, and each decoded
    token's with the options' k alternatives) and readouts equal the hooked reference. Returns the ids."""
    assert options.temperature == 0.0 and options.ignore_eos and not options.stop_token_ids
    assert len(events) == options.max_tokens
    ids = prompt + [e.token_id for e in events]
    sets = [concepts] if steering_set is None else [concepts, steering_set]
    with steered(reference.model, sets, interventions, len(prompt)):
        greedy = reference.greedy(prompt, options.max_tokens)
        logprobs = reference.logprobs(ids).float()
        want = reference_readouts(reference, concepts, ids)
    assert ids[len(prompt) :] == greedy
    assert_logprobs_match(events, logprobs, options.logprobs)
    scores = generation.prompt_scores()
    for position in range(1, len(prompt)):
        assert scores.at(position).logprob == pytest.approx(float(logprobs[position - 1][prompt[position]]), abs=1e-4)
    readouts = {**generation.prompt_readouts, **{e.position: e.readout for e in events}}
    assert sorted(readouts) == list(range(len(ids)))
    assert_readouts_close(readouts, want)
    return ids
