"""Concept sets: named directions in the residual stream, per layer.

File format (safetensors): one float32 tensor `layer.<L>` of shape
[n_concepts, hidden_size] per readout layer, and string metadata:

    salience.format     "concept-set/1"
    concepts            JSON list of concept names (row order)
    layers              JSON list of layer indices (ascending)
    hidden_size         int
    num_layers          the model's number of decoder layers
    model_fingerprint   see `salience.core.models.folders.model_fingerprint`
    provenance          JSON object: how the vectors were built
    concept_info        JSON list, one object or null per concept (absent in older files): how
                        each concept validated and its calibration per layer (probes/fitting.py, validation.py)
    point               the hook point of each layer the vectors read (models/points.py); absent
                        in older files and for resid_post, the residual after the layer

Vectors are used exactly as stored: a builder normalises them, a reader never does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from salience.core.models.folders import model_fingerprint, model_shape
from salience.core.models.points import POINTS, Point
from salience.errors import InvalidArgument, ModelError

__all__ = ["ConceptSet", "ReadoutManifest", "capture_concepts"]

FORMAT = "concept-set/1"


@dataclass(frozen=True, kw_only=True)
class ReadoutManifest:
    """What every frontend tells clients about readouts (the seed proto's ReadoutManifest)."""

    concepts: tuple[str, ...]
    layers: tuple[int, ...]
    hidden_size: int
    dtype: str = "float32"
    point: Point = "resid_post"  # the hook point of each layer readouts read (models/points.py)
    # Per concept, in the order of `concepts`: {name, recommended_layer, method, n_fit, n_heldout,
    # layers: [{layer, scale, offset, auroc, accuracy, ...}], ...}, or None where it was not
    # validated (a set built before calibration, or by hand).
    concept_info: tuple[dict | None, ...] = ()
    version: int = 0  # changes on every live define or delete: a client re-reads the manifest
    live: tuple[str, ...] = ()  # the concepts defined on the running server (probes/live.py)


@dataclass(frozen=True, kw_only=True)
class ConceptSet:
    concepts: tuple[str, ...]
    vectors: dict[int, torch.Tensor]  # layer -> [n_concepts, hidden_size] float32
    hidden_size: int
    num_layers: int
    model_fingerprint: str
    provenance: dict = field(default_factory=dict)
    info: tuple[dict | None, ...] = ()  # concept_info, see ReadoutManifest; () when the file has none
    point: Point = "resid_post"  # where in each layer the vectors read (models/points.py)

    def __post_init__(self) -> None:
        if self.info and len(self.info) != len(self.concepts):
            raise ModelError(f"concept_info has {len(self.info)} entries for {len(self.concepts)} concepts")
        if self.point not in POINTS:
            raise ModelError(f"concept set point {self.point!r} is not one of {', '.join(POINTS)}")

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.vectors))

    @property
    def manifest(self) -> ReadoutManifest:
        return ReadoutManifest(
            concepts=self.concepts,
            layers=self.layers,
            hidden_size=self.hidden_size,
            concept_info=self.info or (None,) * len(self.concepts),
            point=self.point,
        )

    def digest(self) -> str:
        """sha256 of what readouts depend on: names, layers, shape, model, point (a set at resid_post
        keeps the digest it had before there were others) and every vector's bytes."""
        what = [self.concepts, self.layers, self.hidden_size, self.model_fingerprint]
        h = hashlib.sha256(json.dumps(what if self.point == "resid_post" else [*what, self.point]).encode())
        for layer in self.layers:
            h.update(self.vectors[layer].to(torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors, metadata = self._stored()
        save_file(tensors, str(path), metadata=metadata)

    def to_bytes(self) -> bytes:
        """The file `save` writes, as bytes."""
        from safetensors.torch import save

        tensors, metadata = self._stored()
        return save(tensors, metadata=metadata)

    def _stored(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {f"layer.{layer}": v.to(torch.float32).contiguous() for layer, v in self.vectors.items()}
        metadata = {
            "salience.format": FORMAT,
            "concepts": json.dumps(list(self.concepts)),
            "layers": json.dumps(list(self.layers)),
            "hidden_size": str(self.hidden_size),
            "num_layers": str(self.num_layers),
            "model_fingerprint": self.model_fingerprint,
            "provenance": json.dumps(self.provenance),
        }
        if self.info:
            metadata["concept_info"] = json.dumps(list(self.info))
        if self.point != "resid_post":
            metadata["point"] = self.point
        return tensors, metadata

    @classmethod
    def load(cls, path: Path) -> ConceptSet:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                if meta.get("salience.format") != FORMAT:
                    raise ModelError(f"{path} is not a Salience concept set ({FORMAT})")
                concepts = tuple(json.loads(meta["concepts"]))
                layers = [int(layer) for layer in json.loads(meta["layers"])]
                vectors = {layer: handle.get_tensor(f"layer.{layer}").to(torch.float32) for layer in layers}
                concept_set = cls(
                    concepts=concepts,
                    vectors=vectors,
                    hidden_size=int(meta["hidden_size"]),
                    num_layers=int(meta["num_layers"]),
                    model_fingerprint=meta["model_fingerprint"],
                    provenance=json.loads(meta.get("provenance") or "{}"),
                    info=tuple(json.loads(meta["concept_info"])) if "concept_info" in meta else (),
                    point=meta.get("point", "resid_post"),
                )
        except ModelError:
            raise
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise ModelError(f"cannot read concept set {path}: {exc}") from None
        for layer, matrix in vectors.items():
            if tuple(matrix.shape) != (len(concepts), concept_set.hidden_size):
                raise ModelError(
                    f"{path}: layer {layer} holds {tuple(matrix.shape)}, expected "
                    f"({len(concepts)}, {concept_set.hidden_size})"
                )
        return concept_set

    def check_model(self, model_dir: Path) -> None:
        """Refuse a set built for another model, naming what differs."""
        hidden, layers = model_shape(model_dir)
        if self.hidden_size != hidden:
            raise ModelError(f"concept set hidden_size {self.hidden_size} != model hidden_size {hidden}")
        if self.num_layers != layers:
            raise ModelError(f"concept set is for a {self.num_layers}-layer model; this model has {layers} layers")
        bad = [layer for layer in self.layers if not 0 <= layer < layers]
        if bad:
            raise ModelError(f"concept set names layers {bad} outside 0..{layers - 1}")
        fingerprint = model_fingerprint(model_dir)
        if self.model_fingerprint != fingerprint:
            raise ModelError(
                f"concept set was built for model {self.model_fingerprint[:12]}, this model is {fingerprint[:12]}"
            )


def capture_concepts(model: Path, layers: Sequence[int], point: Point = "resid_post") -> ConceptSet:
    """A concept set that puts taps at `point` of `layers` and reads nothing else: one zero concept. What an
    engine serves that only captures residual rows (`salience capture` in process, the concept
    builder) when the model has no concept set of its own."""
    hidden, num_layers = model_shape(model)
    outside = [layer for layer in layers if not 0 <= layer < num_layers]
    if outside:
        raise InvalidArgument(f"layer {outside[0]} is not a layer of this model (0..{num_layers - 1})")
    return ConceptSet(
        concepts=("capture",),
        vectors={layer: torch.zeros(1, hidden) for layer in sorted(layers)},
        hidden_size=hidden,
        num_layers=num_layers,
        model_fingerprint=model_fingerprint(model),
        provenance={"method": "taps for residual capture only"},
        point=point,
    )
