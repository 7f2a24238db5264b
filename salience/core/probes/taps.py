"""Concept readouts and steering inside the model's forward, compiled or eager.

Theory of operation. vLLM compiles the decoder stack (torch.compile; CUDA graphs
on GPU) when the engine starts, before any RPC could reach the worker, and
forward hooks do not fire in a compiled graph. So readouts and steering must be
part of the model the compiler sees:

- `SalienceLoader`, registered as vLLM load format `salience_readouts`, loads
  the weights as vLLM's default loader does and then wraps the module at each
  site (a hook point of a layer, models/points.py) that readouts read,
  steering can name or an SAE encodes in a `Tap`: the decoder layer for
  resid_pre and resid_post, a module inside it (attention, the MLP, a norm)
  for the other points, where the model's family says each point is. vLLM
  resolves the worker extension (engine/worker_extension.py, which imports
  this module) before it loads the model, so the registration is in place in
  every worker process.
- A `Tap` runs its module; takes the residual at its point (`hidden +
  residual` where vLLM's fused add-norm layers carry it as a pair: at
  resid_post, the layer's output before the final norm) in float32; applies
  the step's steering coefficients to it (see Tap),
  which the worker wrote into two static buffers before the step
  (steering_worker.py); and projects the result onto the site's
  `[hidden, concepts]` matrix, writing the `[tokens, concepts]` result into
  slot i of one persistent, statically addressed buffer
  `[max_tokens, layers, concepts]` through the op `salience::readout_store`,
  which declares the buffer as mutated (as vLLM's attention ops declare their
  output buffer). Both are ordinary tensor code, traced and fused with the
  layer; only the small float32 readout block leaves the graph, never a hidden
  state, and only small coefficient blocks enter it. On CPU the projection runs
  in the op `salience::readout_project` instead, gated per step as steering is
  (tap_ops.py: Reading, Steered): a step nobody reads projects nothing, and the spare columns
  of live concepts are projected only once a request reads one.
- A tap at a sparse autoencoder's site (`--sae`: its hook, any point) also encodes the (steered)
  residual with it (`SAEEncoder`: SAELens's math, features/encoder.py) and keeps
  each token's `top` largest feature activations and their ids, written into
  slot i of a second buffer `[max_tokens, SAEs, 2 * top]` through
  `salience::feature_store`. Only those 2 * top floats per token leave the graph.
- A tap at a patch site (`--patch-points`: every layer of those points) sets the activation to
  the values the worker gives for the step's patched rows through `salience::patch`, after any
  steering there, and copies residual rows asked at its site out (patching.py).
- After each step the worker copies the rows requests asked for out of the
  buffers (readout_worker.py); rows past the step's real tokens (padding to a
  compiled or captured batch size) are never read, and their steering
  coefficients are zero.

The vectors are loaded here, before compilation, from content-addressed files
named in vLLM's `additional_config`. vLLM folds `additional_config` into the
hash that keys its compile cache, so a graph built for one concept set (or
steering set, or without steering) is never reused for another.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from salience.core.features.encoder import SAEEncoder
from salience.core.models.families import Family, family_of
from salience.core.models.points import STREAM, Location, Site
from salience.core.probes.compile_cache import load_inductor_artifacts
from salience.core.probes.compile_threads import compile_on_every_core
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.patching import PatchSites
from salience.core.probes.steering import Directions
from salience.core.probes.tap_ops import STAGED_ROWS, steering_delta
from salience.core.probes.warm_up import shorten_warm_up

__all__ = [
    "CODE_KEY",
    "CONFIG_KEY",
    "FAMILY_ATTRIBUTE",
    "FEATURES_KEY",
    "LOAD_FORMAT",
    "PATCH_KEY",
    "STEERING_KEY",
    "Tap",
    "decoder_stack",
    "feature_buffer",
    "file_digest",
    "patch_taps",
    "readout_buffer",
    "steering_buffers",
    "steering_taps",
    "taps",
]

log = logging.getLogger(__name__)

LOAD_FORMAT = "salience_readouts"
# In vLLM's additional_config: {"path", "sha256", "layers", "spare"}: the concept set, and how many
# spare (zero) columns follow its concepts for live concepts (live.py).
CONFIG_KEY = "salience_readouts"
# {"version", "steering": {"path", "sha256"} or None, "spare", "vectors"}: steering along the
# concept set's vectors and those of the steering set, if any, then `spare` columns for live
# concepts and `vectors` for requests' own vectors. Absent: no steering in the graph.
STEERING_KEY = "salience_steering"
STEERING_BUFFERS = ("steer_add", "steer_scale", "steer_lo", "steer_hi")  # a, b, lo, hi (Tap)
# {"saes": [{"path", "sha256", "top"}, ...]}: the sparse autoencoders to encode with, in slot order.
FEATURES_KEY = "salience_features"
# The digest of the traced tap code (start/tap_config.py): only keys the compile cache.
CODE_KEY = "salience_tap_code"
# {"points": [...], "capture_base": int}: patch taps at every layer of these points (patching.py).
PATCH_KEY = "salience_patching"


class Tap(nn.Module):
    """A module of a decoder layer, with steering, a concept projection and SAEs at one hook
    point of it: its input or its output, where the family's `Location` says the point is
    (models/points.py). Any of the three may be absent.

    Steering: with h the residual at the point (float32), D the site's `[hidden, K]` unit
    directions and p = h @ D, h' = h + (a + b * p + clamp(p, lo, hi) - p) @ D.T, where a, b, lo
    and hi are the site's `[tokens, K]` slices of four buffers the worker fills before each step
    (steering_worker.py). The delta goes into the point's first tensor (vLLM's `hidden` where
    the stream is a (hidden, residual) pair), so what reads the point next (the module, for an
    input; the rest of the layer, for an output) sees h'; an unsteered row has a = b = 0,
    lo = -inf and hi = inf and gets exactly 0.0 added. A patch at the site then sets the rows it
    names (tap_ops.patch): the patched value is the one given. The readout and the SAEs read the
    result.
    Columns of D and of the readout matrix that hold no direction are zero and contribute
    exactly nothing; the worker writes live concepts and request vectors into them between
    steps (the graph reads these buffers, never copies them).

    On CPU the steering runs in the op `salience::steer`, which the worker gates per step and
    site (Steered): most steps steer nowhere and most steered requests steer one or two layers,
    while the same math traced into the graph cost ~28 us at every layer of every step (two small
    GEMMs and a fused kernel, 30 layers: 2% of a 16-stream decode step). Under CUDA graphs a
    Python gate would be frozen at capture, so on an accelerator the math stays in the graph.
    """

    def __init__(self, module: nn.Module, site: Site, where: Location) -> None:
        super().__init__()
        self.module = module
        self.site = site
        self.where = where
        self.readout_slot: int | None = None
        self.steering_slot: int | None = None
        self.gated = False  # steering through the gated op (CPU), not traced math
        self.patch_slot: int | None = None
        self.capture_slot = -1  # the residual-capture slot of a patch tap (tap_ops.patch)
        self.encoders = nn.ModuleList()  # the SAEs at this site

    def encode_into(self, encoder: SAEEncoder, buffer: torch.Tensor) -> None:
        self.encoders.append(encoder)
        self.register_buffer("features", buffer, persistent=False)  # [rows, SAEs, 2 * top], shared

    def read_into(
        self,
        slot: int,
        matrices: torch.Tensor,
        buffer: torch.Tensor,
        held: tuple[int, int],
        staging: torch.Tensor | None,
    ) -> None:
        """Read slot `slot` of `matrices` ([slots, concepts, hidden] float32, concept-major, shared)
        into `buffer` ([rows, slots, concepts], shared); `held`: the first and last readout slots
        this stage holds. On CPU a small step's rows go to `staging` ([slots, STAGED_ROWS, hidden],
        shared) and are projected at the last of them (tap_ops.readout_project)."""
        self.readout_slot = slot
        self.readout_held = held
        self.gated_read = staging is not None  # projecting through the gated op (Reading)
        self.register_buffer("matrix", matrices[slot].T, persistent=False)  # [hidden, concepts], a view
        self.register_buffer("out", buffer, persistent=False)
        self.register_buffer("matrices", matrices, persistent=False)
        self.register_buffer("staging", staging, persistent=False)

    def steer_from(self, slot: int, directions: torch.Tensor, coefficients: tuple[torch.Tensor, ...]) -> None:
        self.steering_slot = slot
        self.gated = directions.device.type == "cpu"
        self.register_buffer("directions", directions, persistent=False)  # [hidden, K] float32
        # a, b, lo, hi: each [rows, steering sites, K], shared by every tap
        for name, buffer in zip(STEERING_BUFFERS, coefficients, strict=True):
            self.register_buffer(name, buffer, persistent=False)

    def patch_at(self, slot: int, capture_slot: int) -> None:
        """Patch this site through slot `slot` of the worker's plans (tap_ops.Patched), and copy
        its residual rows out under `capture_slot`."""
        self.patch_slot = slot
        self.capture_slot = capture_slot

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.where.side == "output":
            return self._at(self.module(*args, **kwargs))
        keyword = "hidden_states" in kwargs
        given = kwargs["hidden_states"] if keyword else args[self.where.arg]
        writes = self.steering_slot is not None or self.patch_slot is not None
        if writes and self.site.point not in STREAM:
            given = given.clone()  # a branch's input may be the stream's own tensor (STREAM)
        residual = args[self.where.arg + 1] if self.where.pair else None
        hidden = self._at(given if residual is None else (given, residual))
        hidden = hidden[0] if residual is not None else hidden
        if keyword:
            kwargs = {**kwargs, "hidden_states": hidden}
        else:
            args = (*args[: self.where.arg], hidden, *args[self.where.arg + 1 :])
        return self.module(*args, **kwargs)

    def _at(self, value: Any) -> Any:
        """Steers, reads out and encodes the stream in `value` (a tensor, or a tuple whose first
        tensor is the point's, and whose second is the residual where the stream is a pair), and
        returns `value` as the model goes on with it. A pair's residual is None before vLLM's
        first layer, where the stream is the hidden states alone."""
        whole = value[0] if isinstance(value, tuple) else value
        residual = value[1] if isinstance(value, tuple) and self.where.pair else None
        # [tokens, hidden]: vLLM runs some families' transformers layers on [1, tokens, hidden]. A
        # view, so the gated steering's in-place write lands in the tensor the model goes on with.
        hidden = whole.view(-1, whole.shape[-1])
        if self.steering_slot is not None:
            steering = (self.directions, self.steer_add, self.steer_scale, self.steer_lo, self.steer_hi)
        if self.steering_slot is not None and self.gated:
            torch.ops.salience.steer(hidden, residual, *steering, self.steering_slot)
        state = hidden.float() if residual is None else hidden.float() + residual.float()
        if self.steering_slot is not None and not self.gated:
            delta = steering_delta(state, *steering, self.steering_slot)
            state = state + delta
            whole = (hidden.float() + delta).to(hidden.dtype).view_as(whole)
            value = (whole, *value[1:]) if isinstance(value, tuple) else whole
            hidden = whole.view(-1, whole.shape[-1])
        if self.patch_slot is not None:  # last: the patched value is the one given
            # Computed out of place and copied back: the custom op writing `hidden` in place after a
            # tap had read it made Inductor compute that read before the tensor was written
            # (tests/test_families.py, Gemma with an SAE); aten's copy_ it orders as it should.
            hidden.copy_(torch.ops.salience.patch(hidden, residual, self.patch_slot, self.capture_slot))
            state = hidden.float() if residual is None else hidden.float() + residual.float()
        if self.readout_slot is not None and self.gated_read:
            torch.ops.salience.readout_project(
                state, self.out, self.staging, self.matrices, self.readout_slot, *self.readout_held
            )
        elif self.readout_slot is not None:
            torch.ops.salience.readout_store(state @ self.matrix, self.out, self.readout_slot, state)
        for encoder in self.encoders:
            torch.ops.salience.feature_store(encoder(state), self.features, encoder.slot)
        return value


FAMILY_ATTRIBUTE = "salience_family"  # set on the model by the loader: the family it was loaded as


def decoder_stack(model: nn.Module) -> tuple[range, nn.ModuleList]:
    """The decoder layers (where the model's family says they are), and which of them this
    pipeline stage holds."""
    family: Family = getattr(model, FAMILY_ATTRIBUTE)
    owner, layers = family.stack(model, family.vllm_stack)
    return range(getattr(owner, "start_layer", 0), getattr(owner, "end_layer", len(layers))), layers


def taps(model: nn.Module) -> list[Tap]:
    """Every tap this pipeline stage holds, in module order."""
    return [module for module in decoder_stack(model)[1].modules() if isinstance(module, Tap)]


def readout_buffer(model: nn.Module) -> torch.Tensor | None:
    """The buffer the taps write readouts into, or None if no tap reads out."""
    return next((tap.out for tap in taps(model) if tap.readout_slot is not None), None)


def feature_buffer(model: nn.Module) -> torch.Tensor | None:
    """The buffer the taps write SAE features into, or None without SAEs."""
    return next((tap.features for tap in taps(model) if len(tap.encoders)), None)


def steering_taps(model: nn.Module) -> dict[int, Tap]:
    """The steerable taps this stage holds, by layer."""
    return {tap.site.layer: tap for tap in taps(model) if tap.steering_slot is not None}


def patch_taps(model: nn.Module) -> dict[int, Tap]:
    """The patch taps this stage holds, by patch slot."""
    return {tap.patch_slot: tap for tap in taps(model) if tap.patch_slot is not None}


def steering_buffers(model: nn.Module) -> tuple[tuple[torch.Tensor, ...], dict[int, int]] | None:
    """The coefficient buffers (a, b, lo, hi) and each steerable layer's slot in them, or None
    without steering."""
    steered = steering_taps(model)
    if not steered:
        return None
    first = next(iter(steered.values()))
    return tuple(getattr(first, name) for name in STEERING_BUFFERS), {i: t.steering_slot for i, t in steered.items()}


def _wrap(layers: nn.ModuleList, site: Site, where: Location) -> Tap:
    """A tap at `site`, around the module of layer `site.layer` that `where` names (the layer
    itself, or a module inside it, through any taps already around the layer)."""
    if not where.module:
        layers[site.layer] = Tap(layers[site.layer], site, where)
        return layers[site.layer]
    owner = layers[site.layer]
    while isinstance(owner, Tap):
        owner = owner.module
    *path, name = where.module.split(".")
    for part in path:
        owner = getattr(owner, part)
    # Two points at one module's input (OLMo 2's resid_mid and mlp_in): the stream's tap outside,
    # writing the stream's own tensor, and the branch's inside it, writing its own copy.
    while site.point not in STREAM and _streams_into(getattr(owner, name), where):
        owner, name = getattr(owner, name), "module"
    tap = Tap(getattr(owner, name), site, where)
    setattr(owner, name, tap)
    return tap


def _streams_into(module: nn.Module, where: Location) -> bool:
    """Whether `module` is a stream point's tap at the input `where` also names."""
    return isinstance(module, Tap) and module.where.side == where.side == "input" and module.site.point in STREAM


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_checked(spec: dict) -> ConceptSet:
    path = Path(spec["path"])
    if file_digest(path) != spec["sha256"]:
        raise RuntimeError(f"concept set {path} changed after the engine was configured")
    return ConceptSet.load(path)


def _install_taps(model: nn.Module, config: dict, max_tokens: int, device: torch.device) -> None:
    family: Family = getattr(model, FAMILY_ATTRIBUTE)
    readout_spec, steering_spec, features_spec, patch_spec = (
        config.get(CONFIG_KEY),
        config.get(STEERING_KEY),
        config.get(FEATURES_KEY),
        config.get(PATCH_KEY),
    )
    concepts = _load_checked(readout_spec) if readout_spec is not None else None
    directions = None
    if steering_spec is not None:
        extra = _load_checked(steering_spec["steering"]) if steering_spec.get("steering") else None
        directions = Directions(concepts, extra, spare=steering_spec["spare"], vectors=steering_spec["vectors"])
    held, layers = decoder_stack(model)
    tapped: dict[Site, Tap] = {}

    def tap(site: Site) -> Tap:
        if site not in tapped:
            tapped[site] = _wrap(layers, site, family.locate(site.point))
        return tapped[site]

    # Every layer gets its slot whether or not this pipeline stage holds it, so slots agree across stages.
    if concepts is not None:
        width = len(concepts.concepts) + readout_spec["spare"]
        buffer = torch.zeros(max_tokens, len(concepts.layers), width, dtype=torch.float32, device=device)
        # Stored concept-major and used transposed: the gated op's [hidden, n] slice is then one
        # BLAS operand as it lies (a [hidden, width] slice was copied first: 2x the product at 16
        # rows, measured). One tensor for every slot: a small step projects them all at once.
        matrices = torch.zeros(len(concepts.layers), width, concepts.hidden_size, dtype=torch.float32)
        slots = [slot for slot, index in enumerate(concepts.layers) if index in held]
        for slot in slots:
            matrices[slot, : len(concepts.concepts)] = concepts.vectors[concepts.layers[slot]].to(torch.float32)
        matrices = matrices.to(device)
        staging = None
        if device.type == "cpu":  # the gated op's (Reading)
            staging = torch.zeros(len(concepts.layers), STAGED_ROWS, concepts.hidden_size, device=device)
        for slot in slots:
            site = Site(concepts.layers[slot], concepts.point)
            tap(site).read_into(slot, matrices, buffer, (slots[0], slots[-1]), staging)
    if directions is not None:
        shape = (max_tokens, len(directions.layers), directions.width)
        coefficients = tuple(
            torch.full(shape, fill, dtype=torch.float32, device=device) for fill in (0.0, 0.0, -torch.inf, torch.inf)
        )
        for slot, index in enumerate(directions.layers):
            if index in held:
                matrix = directions.matrix(index).to(device).contiguous()
                tap(Site(index, directions.point)).steer_from(slot, matrix, coefficients)
    if features_spec is not None:
        from salience.core.features.sae import load_sae

        saes = features_spec["saes"]
        widest = max(spec["top"] for spec in saes)
        buffer = torch.zeros(max_tokens, len(saes), 2 * widest, dtype=torch.float32, device=device)
        for slot, spec in enumerate(saes):
            sae = load_sae(Path(spec["path"]))
            if sae.sha256 != spec["sha256"]:
                raise RuntimeError(f"SAE {spec['path']} changed after the engine was configured")
            if sae.site.layer in held:
                encoder = SAEEncoder(sae, spec["top"], slot).to(device)
                encoder.prepack()
                tap(sae.site).encode_into(encoder, buffer)
    if patch_spec is not None:
        sites = PatchSites(patch_spec["points"], len(layers), 0, patch_spec["capture_base"])
        for point in sites.points:
            for index in held:
                site = Site(index, point)
                tap(site).patch_at(sites.slot(site), sites.capture_slot(site))
    log.debug("taps installed", extra={"sites": [str(site) for site in sorted(tapped)], "rows": max_tokens})


def _register_loader() -> None:
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register_model_loader(LOAD_FORMAT)
    class SalienceLoader(DefaultModelLoader):
        """vLLM's default loader, then taps on the layers readouts read and steering can name."""

        def __init__(self, load_config) -> None:
            # The weights themselves are found as "auto" finds them.
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_model(self, vllm_config, model_config, prefix: str = "") -> nn.Module:
            if vllm_config.device_config.device_type == "cpu":
                load_inductor_artifacts()
                compile_on_every_core()
                shorten_warm_up()
            model = super().load_model(vllm_config, model_config, prefix)
            config = vllm_config.additional_config or {}
            if any(key in config for key in (CONFIG_KEY, STEERING_KEY, FEATURES_KEY, PATCH_KEY)):
                setattr(model, FAMILY_ATTRIBUTE, family_of(model_config.architectures))
                # Every rank taps and steers (the same values); rank 0's readouts are read.
                rows = vllm_config.scheduler_config.max_num_batched_tokens
                device = next(model.parameters()).device
                _install_taps(model, config, rows, device)
            return model


_register_loader()
