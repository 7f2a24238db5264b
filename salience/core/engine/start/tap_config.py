"""The tap config: which taps Salience's loader puts into the model (probes/taps.py), with the
spare columns live concepts write into. vLLM's engine arguments carry it to the loader, and
install_probes (engine/live.py) sets up the taps it put in, so both read it from here."""

from __future__ import annotations

import hashlib
from pathlib import Path

from salience.core.engine.settings import EngineSettings
from salience.core.engine.start.served_saes import sae_top
from salience.core.models.atomic import build_folder_once
from salience.core.models.home import salience_home
from salience.core.probes.concepts import ConceptSet
from salience.core.probes.taps import CODE_KEY, CONFIG_KEY, FEATURES_KEY, PATCH_KEY, STEERING_KEY, file_digest

__all__ = ["capture_base", "spare_columns", "steers", "tap_config"]


def tap_config(settings: EngineSettings) -> dict:
    """The `additional_config` that tells Salience's loader which taps to put into the model
    (probes/taps.py): readouts with a concept set (and spare columns for live concepts), steering
    along its vectors, the steering set's and requests' own unless steering is off, SAEs, and
    patching at every layer of the patch points.

    The taps load the vectors from content-addressed copies of the sets; their digests in
    `additional_config` key vLLM's compile cache, so other sets never reuse a graph compiled
    for these.
    """
    concepts, steering_set = settings.concepts, settings.steering_set
    spare = spare_columns(settings)
    config: dict = {}
    if concepts is not None:
        config[CONFIG_KEY] = {**_stored(concepts), "layers": list(concepts.layers), "spare": spare}
    if steers(settings):
        config[STEERING_KEY] = {
            "version": 2,
            "steering": _stored(steering_set) if steering_set is not None else None,
            "spare": spare,
            "vectors": settings.steer_vectors,
        }
    if settings.saes:
        config[FEATURES_KEY] = {
            "saes": [
                {"path": str(sae.folder), "sha256": sae.sha256, "top": sae_top(sae, settings)} for sae in settings.saes
            ]
        }
    if settings.patch_points:
        config[PATCH_KEY] = {"points": list(settings.patch_points), "capture_base": capture_base(settings)}
    if config:
        config[CODE_KEY] = tap_code_digest()
    return config


def tap_code_digest() -> str:
    """The digest of the code the compiler traces into the model's graph besides vLLM's own: the
    taps, their ops and the SAE encoder. vLLM keys its AOT artifact by its config (this config
    included) and the model's own sources, not these: without it, a start after an upgrade of
    Salience loaded a graph compiled from the old taps."""
    import salience.core.features.encoder as encoder
    import salience.core.probes.tap_ops as tap_ops
    import salience.core.probes.taps as taps

    digest = hashlib.sha256()
    for module in (taps, tap_ops, encoder):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()


def capture_base(settings: EngineSettings) -> int:
    """The first residual-capture slot of the patch taps: the readout taps' slots come first."""
    return len(settings.concepts.layers) if settings.concepts is not None else 0


def spare_columns(settings: EngineSettings) -> int:
    """Columns for live concepts: they need readouts (a concept set)."""
    return settings.spare_concepts if settings.concepts is not None else 0


def steers(settings: EngineSettings) -> bool:
    """Whether steering taps go in: steering is on and there is something to steer along."""
    return settings.steering and (settings.concepts is not None or settings.steering_set is not None)


def _stored(concept_set: ConceptSet) -> dict[str, str]:
    """A content-addressed copy of the set under $SALIENCE_HOME: its path and file digest."""
    digest = concept_set.digest()
    folder = build_folder_once(
        salience_home() / "concept-sets" / digest[:24], lambda out: concept_set.save(out / "concepts.safetensors")
    )
    path = folder / "concepts.safetensors"
    return {"path": str(path), "sha256": file_digest(path)}
