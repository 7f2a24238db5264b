"""Inside the vLLM worker: the requests of the step about to run, as the workers read them.

A request asks a worker for its work through a tag in `SamplingParams.extra_args`; the runner
holds the step's requests in batch order (`input_batch.req_ids`), their token rows from
`query_start_loc`, and each row's absolute position in `positions`. Every worker that plans a
step (readouts, steering, patching, raw logprobs) reads them through these two functions, and
a worker that parses a request's payload keeps the parse in `Plans` while the request lives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["Plans", "step_rows", "tagged"]


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


class Plans:
    """Each request's payload as a worker parsed it, parsed once per request (a payload is one
    object for the request's life); the parses of requests the runner no longer holds are
    dropped once there are more than `4 * max_num_reqs`, or when asked."""

    def __init__(self, runner: Any, parse: Callable[[list], list]) -> None:
        self._runner = runner
        self._parse = parse
        self._plans: dict[str, tuple[object, list]] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def of(self, request_id: str, payload: list) -> list:
        cached = self._plans.get(request_id)
        if cached is not None and cached[0] is payload:
            return cached[1]
        if len(self._plans) > 4 * self._runner.max_num_reqs:
            self.forget()
        plan = self._parse(payload)
        self._plans[request_id] = (payload, plan)
        return plan

    def forget(self) -> None:
        """Drop the plans of requests the runner no longer holds."""
        live = self._runner.requests
        for request_id in [r for r in self._plans if r not in live]:
            del self._plans[request_id]
