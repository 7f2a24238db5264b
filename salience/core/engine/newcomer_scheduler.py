"""In the engine core: a newcomer's prompt gets a step of its own, at most once every EVERY steps.

On a contended engine a request's first token waits for the step in flight, then comes out of
a step shared with every running request's decode: on two cores, with 64 decodes a step takes
about twice a short prompt's prefill alone, so a client that was idle waits ~5x its idle time to
first token. Fair share (fair_share.py) marks a request as a newcomer (`extra_args[NEWCOMER]`)
when its client had nothing running while others did; this scheduler (`scheduler_cls`) then
schedules the waiting newcomers in a step without the running requests' decodes, which wait one
step (vLLM keeps their state; a running request left out of a step is how it handles a spent
token budget). That was vLLM's own default before v1 (prefills before decodes), for every
request; here it is for a client's first request only, and at most one such step in EVERY, so
the others' decodes lose at most one step in EVERY however many clients come and go.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from salience.core.probes.fault_scheduler import FaultScheduler
from salience.core.probes.readout_scheduler import ReadoutScheduler

__all__ = ["EVERY", "NEWCOMER", "NewcomerScheduler", "ReadoutNewcomerScheduler", "TappedNewcomerScheduler"]

NEWCOMER = "salience_newcomer"
EVERY = 32


class NewcomerScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._since_alone = EVERY  # steps since a newcomers' step

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        self._since_alone += 1
        if not self.running or self._since_alone < EVERY or not any(_newcomer(r) for r in self.waiting):
            return super().schedule(*args, **kwargs)
        running, others = self.running, [r for r in self.waiting if not _newcomer(r)]
        self.running = []
        self.waiting.remove_requests(others)
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self.running = running + self.running  # the newcomers it scheduled joined the empty list
            for request in others:
                self.waiting.add_request(request)
        self._since_alone = 0
        return output


class TappedNewcomerScheduler(FaultScheduler, NewcomerScheduler):
    """With taps in the forward, whose failures fail requests (probes/fault_scheduler.py): both."""


class ReadoutNewcomerScheduler(FaultScheduler, NewcomerScheduler, ReadoutScheduler):
    """With readouts carried on the step's output (probes/readout_scheduler.py) as well: all three.
    The faulted requests are finished first, so no readout rows go out with their error."""


def _newcomer(request: Request) -> bool:
    params = request.sampling_params
    return params is not None and bool((params.extra_args or {}).get(NEWCOMER))
