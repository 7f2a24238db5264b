"""The vLLM worker extension Salience loads: readouts and steering, driven through collective_rpc."""

from __future__ import annotations

from salience.core.readout_worker import ReadoutWorker
from salience.core.steering_worker import SteeringWorker

__all__ = ["SalienceWorker"]


class SalienceWorker(ReadoutWorker, SteeringWorker):
    """Mixed into vLLM's worker class (`worker_extension_cls`)."""
