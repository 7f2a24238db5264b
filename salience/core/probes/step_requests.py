"""Inside the vLLM worker: the requests of the step about to run, as the workers read them.

A request asks a worker for its work through a tag in `SamplingParams.extra_args`; the runner
holds the step's requests in batch order (`input_batch.req_ids`), their token rows from
`query_start_loc`, and each row's absolute position in `positions`. Every worker that plans a
step (readouts, steering, patching, raw logprobs) reads them through these two functions.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["step_rows", "tagged"]


def tagged(runner: Any, tag: str) -> Iterator[tuple[int, str, dict]]:
    """The step's requests tagged `tag`: batch index, vLLM request id, extra_args."""
    batch = runner.input_batch
    for i, request_id in enumerate(batch.req_ids[: batch.num_reqs]):
        extra = getattr(getattr(runner.requests.get(request_id), "sampling_params", None), "extra_args", None)
        if extra and tag in extra:
            yield i, request_id, extra


def step_rows(runner: Any) -> tuple[np.ndarray, np.ndarray]:
    """Where each request's rows start (`starts[i]` to `starts[i + 1]`, batch order) and every row's
    absolute position, as the runner holds them now (the next step rewrites them)."""
    n = runner.input_batch.num_reqs
    starts = runner.query_start_loc.cpu[: n + 1].numpy()
    return starts, runner.positions[: int(starts[n])].cpu().numpy()
