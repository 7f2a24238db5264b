"""Inside the vLLM worker: a failure in Salience's own per-step code fails the requests that asked
for that work in that step, and the engine goes on serving.

Theory of operation. An exception that leaves vLLM's `execute_model` stops its engine core: every
request in flight and every later one then fails. Salience runs code in every step, the ops its
taps call inside the model's forward (tap_ops.py) and the workers' Python around the forward
(readout_worker.py, steering_worker.py), so none of it may raise into the step:

- An op catches what its body raises, records (op, slot, exception) in tap_ops.Faults and returns;
  the forward finishes. Its buffer's rows are stale, or, for `steer`, whose one write comes last,
  the hidden state is left unsteered: only the requests that asked for that op's work can tell.
- After the forward, the worker that set the op's gate names those requests (`_ft_fail`): every
  request reading concepts in the step for a projection, those asking residual rows at that layer
  for a capture, an SAE's features for its store, steering at that layer for a steer. The
  workers' own per-step Python fails the one request it was working for when it raises, or
  every request that asked for that work in the step when the failure is not one request's.
- The step's failed requests, each with what failed, ride on the step's output (FAULTS), as
  readout rows do; the engine core's scheduler (fault_scheduler.py) finishes them with vLLM's
  error status and the reason, and the frontend raises it as that request's EngineError
  (engine/output_streams.py). Every other request of the batch is untouched: rows, coefficients
  and blocks are filed per request.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from salience.core.probes.tap_ops import Faults

__all__ = ["FAULTS", "INJECTABLE", "FaultWorker", "taken"]

log = logging.getLogger(__name__)

FAULTS = "salience_faults"  # the ModelRunnerOutput attribute: {vLLM request id: what failed}
# The ops a test may make fail (FaultWorker.salience_test_fault), as tap_ops.Faults names them.
INJECTABLE = frozenset({"steer", "patch", "readout_project", "readout_store", "residual_capture", "feature_store"})


def taken(ops: frozenset[str]) -> list[tuple[str, int, Exception]]:
    """The faults of `ops` the forward recorded, removed from tap_ops.Faults."""
    if not Faults.raised:
        return []
    mine = [fault for fault in Faults.raised if fault[0] in ops]
    Faults.raised = [fault for fault in Faults.raised if fault[0] not in ops]
    return mine


class FaultWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_faults_setup(self) -> None:
        """Send each step's failed requests with its output. Called after the readout and steering
        setups, so that this wraps theirs: what they fail while filing goes out with the same step."""
        self._ft_failed: dict[str, str] = {}  # this step's failed requests: vLLM request id -> what failed
        runner = self.model_runner
        runner.execute_model = self._ft_sending(runner.execute_model)
        runner.sample_tokens = self._ft_sending(runner.sample_tokens)

    def salience_test_fault(self, op: str | None, slot: int = 0) -> None:
        """Tests only: make op `op` fail at `slot` in every later step, as a bug in it would (None:
        stop). Nothing else calls it, so a server never fails on purpose."""
        if op is not None and op not in INJECTABLE:
            raise ValueError(f"no op {op!r} to fail; one of {sorted(INJECTABLE)}")
        Faults.injected = None if op is None else (op, slot)

    def _ft_fail(self, request_ids: Iterable[str], what: str, exc: Exception) -> None:
        """Fail `request_ids` in this step: `what` raised `exc`. Logged once, as an error with the
        requests it fails and its traceback at debug; at debug alone if it fails none (an SAE's
        store whose features nobody reads: it would repeat at every step)."""
        reason = f"{what} failed ({type(exc).__name__}: {exc})"
        failed = [request_id for request_id in request_ids if request_id not in self._ft_failed]
        self._ft_failed.update(dict.fromkeys(failed, reason))
        log.log(
            logging.ERROR if failed else logging.DEBUG,
            "%s; the requests that asked for it fail, the engine keeps serving",
            reason,
            extra={"fault": what, "error": type(exc).__name__, "requests": ",".join(failed)},
            exc_info=exc if log.isEnabledFor(logging.DEBUG) else None,
        )

    def _ft_sending(self, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            if result is None:  # the output comes from sample_tokens
                return result
            if self._ft_failed and isinstance(result, ModelRunnerOutput):
                if result is EMPTY_MODEL_RUNNER_OUTPUT:  # vLLM's shared one: copied, never written
                    result = copy.copy(result)
                setattr(result, FAULTS, self._ft_failed)
            self._ft_failed = {}
            if Faults.raised:  # no worker took them: a rank whose rows nobody files
                for op, slot, exc in Faults.raised:
                    log.warning("salience::%s failed at slot %d (%r)", op, slot, exc, extra={"fault": op})
                Faults.raised = []
            return result

        return run
