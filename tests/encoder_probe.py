"""A test-only vLLM worker extension: Salience's worker plus a count of vision-encoder passes.

Passed as `worker_extension_cls` through EngineSettings.engine_args, so tests can show which
turns run the vision encoder (vLLM's cached-token count alone only implies it)."""

from __future__ import annotations

from salience.core.engine.worker_extension import SalienceWorker


class EncoderCountingWorker(SalienceWorker):
    def salience_test_encoder_passes(self) -> int:
        """Forward passes of the vision tower since the first call of this method."""
        if not hasattr(self, "_encoder_passes"):
            self._encoder_passes = 0

            def count(*_: object) -> None:
                self._encoder_passes += 1

            self.model_runner.get_model().visual.register_forward_hook(count)
        return self._encoder_passes
