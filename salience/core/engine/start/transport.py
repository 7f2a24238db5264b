"""The readout transport: whether readout rows ride on each step's output or are fetched between
steps (docs/readouts.md). The engine arguments (the scheduler vLLM runs) and the readout hub
(how it gathers rows) must agree, so both ask here."""

from __future__ import annotations

from salience.core.engine.settings import EngineSettings

__all__ = ["readouts_with_output"]


def readouts_with_output(settings: EngineSettings, cpu: bool) -> bool:
    """Whether readout rows ride on each step's output (probes/readouts.py). That needs one
    filing worker whose output vLLM returns (one pipeline stage) and a step whose output is
    ready when the step returns: on CPU vLLM never schedules asynchronously. Elsewhere they are
    fetched between steps."""
    return settings.concepts is not None and cpu and settings.pipeline_parallel_size == 1
