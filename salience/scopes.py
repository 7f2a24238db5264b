"""The scope each operation needs, on every wire: one table, which docs/security.md shows and a
test walks on a real server. An operation needs its own scopes, and a generation or a score
also those its fields ask for (`asked`): readouts, steering, residual rows, SAE features. A scope
is checked before anything reaches the engine; the error names the first one missing."""

from __future__ import annotations

from salience.core.engine.requests import Probes

__all__ = ["OPEN", "OPERATIONS", "asked", "needs"]

OPEN = "open"  # no token at all: health probes and the page

_SESSION_TURN = ("sessions", "generate")
OPERATIONS: dict[str, tuple[str, ...] | str] = {
    # LMTP message types (WebSocket and TCP)
    "LMTP GENERATE": ("generate",),
    "LMTP SCORE": ("score",),
    "LMTP SESSION_GENERATE": _SESSION_TURN,
    "LMTP OPEN_SESSION": ("sessions",),
    "LMTP CLOSE_SESSION": ("sessions",),
    "LMTP FORK_SESSION": ("sessions",),
    "LMTP DUMP_SESSION": ("sessions",),
    "LMTP DEFINE_CONCEPT": ("define",),
    "LMTP DELETE_CONCEPT": ("define",),
    "LMTP SAVE_CONCEPTS": ("define",),
    "LMTP PATCH_SWEEP": ("score", "steer"),
    "LMTP MODEL_INFO": (),
    "LMTP STATUS": (),
    "LMTP TOKENIZE": (),
    "LMTP DETOKENIZE": (),
    "LMTP IMAGE_INFO": (),
    "LMTP CANCEL": (),
    # HTTP
    "GET /v1/models": (),
    "GET /v1/models/{model}": (),
    "POST /v1/completions": ("generate",),
    "POST /v1/chat/completions": ("generate",),
    "POST /v1/responses": ("generate",),
    "GET /v1/responses/{id}": ("generate",),
    "DELETE /v1/responses/{id}": ("generate",),
    "GET /metrics": (),
    "GET /health": OPEN,
    "GET /ui/": OPEN,
    # gRPC
    "salience.v1.Salience/OpenSession": ("sessions",),
    "salience.v1.Salience/CloseSession": ("sessions",),
    "salience.v1.Salience/ForkSession": ("sessions",),
    "salience.v1.Salience/Generate": _SESSION_TURN,
    "salience.v1.Salience/GetReadoutManifest": (),
    "salience.v1.Salience/DumpSession": ("sessions",),
    "salience.ext.v1.SalienceExtensions/ImageInfo": (),
    "salience.ext.v1.SalienceExtensions/SteeredGenerate": _SESSION_TURN,
    "salience.ext.v1.SalienceExtensions/GetSteeringManifest": (),
    "salience.ext.v1.SalienceExtensions/ChatGenerate": _SESSION_TURN,
    "salience.ext.v1.SalienceExtensions/ExtendedGenerate": _SESSION_TURN,
    "salience.ext.v1.SalienceExtensions/GetConceptManifest": (),
    "salience.ext.v1.SalienceExtensions/GetSAEManifest": (),
    "salience.ext.v1.SalienceExtensions/DefineConcept": ("define",),
    "salience.ext.v1.SalienceExtensions/DeleteConcept": ("define",),
    "salience.ext.v1.SalienceExtensions/SaveConcepts": ("define",),
    "salience.ext.v1.SalienceExtensions/PatchSweep": ("score", "steer"),
    "grpc.health.v1.Health/Check": OPEN,
    "grpc.health.v1.Health/Watch": OPEN,
    "grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": (),
}


def needs(operation: str) -> tuple[str, ...]:
    """The operation's own scopes (an operation missing from the table is a bug: KeyError)."""
    scopes = OPERATIONS[operation]
    return () if scopes == OPEN else tuple(scopes)


def asked(probes: Probes) -> tuple[str, ...]:
    """The scopes a generation's or a score's probes ask for: concept readouts (shown, or read by
    a concept monitor), steering (patches too: they intervene), residual rows, and SAE features
    (read, steered along or monitored)."""
    out = []
    if probes.readout_ranges or any(m.feature is None for m in probes.monitors):
        out.append("readouts")
    if probes.steer or probes.patch:
        out.append("steer")
    if probes.residual is not None:
        out.append("residual")
    if (
        probes.features is not None
        or any(i.feature is not None for i in probes.steer)
        or any(m.feature is not None for m in probes.monitors)
    ):
        out.append("features")
    return tuple(out)
