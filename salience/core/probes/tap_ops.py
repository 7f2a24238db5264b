"""The ops a layer tap (taps.py) calls inside the compiled graph, and the per-step gates the
workers set around each forward.

On CPU there is no CUDA graph to freeze a Python decision, so the projection and the steering run
in ops that look at a gate first (Reading, Steered): a step nobody reads or steers costs one check
per tapped layer. The stores declare the buffer they write as mutated, as vLLM's attention ops
declare their output buffer, so functionalization keeps the writes. Registered straight with the
dispatcher when this module is imported (taps.py imports it in every worker process).

No op raises into the forward: an exception leaving it would leave vLLM's execute_model and stop
the engine, every request with it. An op that fails records the failure in Faults and returns,
its side buffer stale (or, for steer, whose one write comes last, the hidden state unsteered);
the worker fails the requests that asked for its work in that step (faults.py). A try costs
nothing until it catches.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.library import Library

__all__ = ["STAGED_ROWS", "Capture", "Faults", "Patched", "Reading", "Steered", "steering_delta"]


class Capture:
    """Residual rows the worker asked the next forward to copy out (readout_worker.py): set
    before the forward, taken after it. Empty, the taps copy nothing."""

    rows: ClassVar[torch.Tensor | None] = None  # the step's token rows to copy, ascending
    slots: ClassVar[frozenset[int]] = frozenset()  # the readout slots (layers) to copy them at
    taken: ClassVar[dict[int, torch.Tensor]] = {}  # readout slot -> [len(rows), hidden] float32


class Reading:
    """The readout columns some request of the next forward reads (0: none does), set by the worker
    before it (readout_worker.py). On CPU a tap projects onto those columns only, and only then:
    the spare columns of live concepts cost nothing until one is read, nor does a step nobody
    reads."""

    columns: ClassVar[int] = 0


class Steered:
    """The steering slots (layers) some request of the next forward steers at, set by the worker
    before it (steering_worker.py). On CPU a tap whose slot is not here skips its steering code."""

    slots: ClassVar[frozenset[int]] = frozenset()


class Patched:
    """The rows the next forward patches, per patch slot (site): the step's token rows (ascending)
    and their float32 values [rows, hidden] as the stream takes them, set by the worker before it
    (patch_worker.py). Empty, every patch tap only checks."""

    plans: ClassVar[dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}


class Faults:
    """The ops that failed during the forward, as (op, slot, exception) in the order they failed:
    appended by the ops, taken after the forward by the worker that set their gates (faults.py).
    `injected`: tests only (faults.FaultWorker.salience_test_fault), an (op, slot) made to fail."""

    raised: ClassVar[list[tuple[str, int, Exception]]] = []
    injected: ClassVar[tuple[str, int] | None] = None


def _inject(op: str, slot: int) -> None:
    if Faults.injected == (op, slot):
        raise RuntimeError(f"{op} failed on purpose at slot {slot} (the fault-injection test hook)")


def steer(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    directions: torch.Tensor,
    add: torch.Tensor,
    scale: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    slot: int,
) -> None:
    """hidden += (a + b * p + clamp(p, lo, hi) - p) @ D.T at a steered slot (Tap), else
    nothing: an opaque op runs as Python at every step, so a step that steers nowhere here costs
    one set lookup instead of the projection onto every direction and back."""
    if slot not in Steered.slots:
        return
    try:
        if Faults.injected is not None:
            _inject("steer", slot)
        state = hidden.float() if residual is None else hidden.float() + residual.float()
        hidden.copy_((hidden.float() + steering_delta(state, directions, add, scale, lo, hi, slot)).to(hidden.dtype))
    except Exception as exc:
        Faults.raised.append(("steer", slot, exc))


def patch(hidden: torch.Tensor, residual: torch.Tensor | None, slot: int, capture_slot: int) -> torch.Tensor:
    """The activation at a patch site with the worker's values at its rows (Patched): `hidden`,
    or where the stream is a (hidden, residual) pair, hidden such that hidden + residual is the
    value; a new tensor (the tap copies it back). Residual rows asked at this site are copied
    out (Capture, under `capture_slot`), patched as the model goes on with them."""
    out = hidden.clone()
    plan = Patched.plans.get(slot) if Patched.plans else None
    if plan is not None:
        try:
            if Faults.injected is not None:
                _inject("patch", slot)
            rows, values = plan
            if residual is not None:
                values = values - residual.index_select(0, rows).float()
            out.index_copy_(0, rows, values.to(out.dtype))
        except Exception as exc:
            Faults.raised.append(("patch", slot, exc))
    if Capture.rows is not None and capture_slot in Capture.slots:
        _capture(out.float() if residual is None else out.float() + residual.float(), capture_slot)
    return out


def steering_delta(
    state: torch.Tensor,
    directions: torch.Tensor,
    add: torch.Tensor,
    scale: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    slot: int,
) -> torch.Tensor:
    """(a + b * p + clamp(p, lo, hi) - p) @ D.T, p = state @ D, with this slot's coefficient rows."""
    rows = state.shape[0]
    a, b = add[:rows, slot], scale[:rows, slot]
    projection = state @ directions
    clamped = torch.clamp(projection, lo[:rows, slot], hi[:rows, slot])
    return (a + b * projection + (clamped - projection)) @ directions.T


def readout_store(values: torch.Tensor, buffer: torch.Tensor, slot: int, state: torch.Tensor) -> None:
    """buffer[:rows, slot] = values: the graph's one write, into a buffer at a fixed address. Where
    the worker asked for residual rows (Capture), `state`'s rows are copied out as well: an opaque
    op runs as Python at every step, so this costs one check when nothing is asked."""
    try:
        if Faults.injected is not None:
            _inject("readout_store", slot)
        buffer[: values.shape[0], slot].copy_(values)
    except Exception as exc:
        Faults.raised.append(("readout_store", slot, exc))
    _capture(state, slot)


def readout_project(
    state: torch.Tensor,
    buffer: torch.Tensor,
    staging: torch.Tensor,
    matrices: torch.Tensor,
    slot: int,
    first: int,
    last: int,
) -> None:
    """buffer[:rows, slot, :n] = state @ matrices[slot, :n].T with n the columns the step reads
    (Reading), nothing when it reads none; then residual rows as readout_store copies them.

    A step of STAGED_ROWS rows or fewer (a decode step's) is projected at once: each tap copies its
    rows into `staging` ([slots, STAGED_ROWS, hidden]) and the tap of the stage's last readout slot
    (`last`; its first is `first`) projects slots first..last in one batched product with
    `matrices` ([slots, width, hidden], concept-major; every tap's `matrix` is a view of it). Layer by layer the
    forward evicts each small product's operands: in the engine a 1-row product took 9 us, 1 us warm.
    A bigger step writes each layer's product straight into the buffer, through views kept from
    the last call of this shape (slicing and a copy cost more than the product)."""
    columns = Reading.columns
    if columns:
        try:
            if Faults.injected is not None:
                _inject("readout_project", slot)
            rows = state.shape[0]
            key = (buffer.data_ptr(), slot, rows, columns)
            views = _views.get(key)
            if views is None:
                if len(_views) > _MAX_VIEWS:
                    _views.clear()
                if rows <= STAGED_ROWS:
                    held = slice(first, last + 1)
                    views = (staging[slot, :rows], staging[held, :rows], matrices[held, :columns].transpose(1, 2))
                    views += (buffer[:rows, held, :columns].transpose(0, 1),)
                else:
                    views = (matrices[slot, :columns].T, buffer[:rows, slot, :columns])
                _views[key] = views
            if rows > STAGED_ROWS:
                torch.mm(state, views[0], out=views[1])
            else:
                views[0].copy_(state)
                if slot == last:
                    views[3].copy_(torch.bmm(views[1], views[2]))
        except Exception as exc:
            Faults.raised.append(("readout_project", slot, exc))
    _capture(state, slot)


STAGED_ROWS = 64  # steps of this many rows or fewer project every layer at once (readout_project)
_views: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = {}
_MAX_VIEWS = 4096  # batch sizes x column counts x layers seen; decode steps repeat a few


def _capture(state: torch.Tensor, slot: int) -> None:
    if Capture.rows is not None and slot in Capture.slots:
        try:
            if Faults.injected is not None:
                _inject("residual_capture", slot)
            Capture.taken[slot] = state.index_select(0, Capture.rows).cpu()
        except Exception as exc:
            Faults.raised.append(("residual_capture", slot, exc))


def feature_store(values: torch.Tensor, buffer: torch.Tensor, slot: int) -> None:
    """buffer[:rows, slot, :width] = values: an SAE's top features, as readout_store writes readouts."""
    try:
        if Faults.injected is not None:
            _inject("feature_store", slot)
        buffer[: values.shape[0], slot, : values.shape[1]].copy_(values)
    except Exception as exc:
        Faults.raised.append(("feature_store", slot, exc))


def _no_output(*args: Any) -> None:
    return None


def _like_hidden(hidden: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(hidden)


def _register_ops() -> Library:
    """The stores, the gated projection, the steering gate and the patch as `torch.ops.salience.*`, registered
    straight with the dispatcher as vLLM registers its attention ops: `torch.library.custom_op`'s
    own Python wrapping costs ~15 us more per call, and the compiled graph calls them at every
    tapped layer of every step."""
    from vllm.utils.torch_utils import direct_register_custom_op

    library = Library("salience", "FRAGMENT")
    ops = ((readout_store, "buffer"), (readout_project, "buffer"), (feature_store, "buffer"), (steer, "hidden"))
    for op, mutated in ops:
        direct_register_custom_op(op.__name__, op, mutates_args=[mutated], fake_impl=_no_output, target_lib=library)
    direct_register_custom_op("patch", patch, mutates_args=[], fake_impl=_like_hidden, target_lib=library)
    return library


_LIBRARY = _register_ops()  # the ops live as long as this object
