"""vLLM's output stream of one request, wrapped: its failures as Salience's errors, its readout
state released however it ends, and nothing sent to vLLM before the request's gate opens."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Protocol

from salience.errors import EngineError, InvalidArgument

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

    from salience.core.probes.readouts import ReadoutHub

__all__ = ["Gate", "admitted", "guarded", "releasing"]


async def guarded(outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[RequestOutput]:
    """Map vLLM's request failures to EngineError, the engine's end of one request for a fault
    included; cancellation passes through."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    try:
        async for out in outputs:
            completion = out.outputs[0] if out.outputs else None
            if (
                completion is not None
                and completion.finish_reason == "error"
                and isinstance(completion.stop_reason, str)
            ):
                # A fault in Salience's per-step code failed this request alone (probes/faults.py).
                raise EngineError(f"{completion.stop_reason}: this request failed; the server keeps serving")
            yield out
    except EngineDeadError as exc:
        raise EngineError("the engine has stopped") from exc
    except EngineGenerateError as exc:
        raise EngineError(f"the engine failed the request: {exc.__cause__ or exc}") from exc
    except (ValueError, VLLMClientError) as exc:  # vLLM's request validation
        raise InvalidArgument(str(exc)) from exc
    finally:
        # Closing vLLM's generator is what aborts an unfinished request.
        await outputs.aclose()


async def releasing(
    outputs: AsyncGenerator[RequestOutput, None], hub: ReadoutHub, keys: list[str]
) -> AsyncGenerator[RequestOutput, None]:
    """Free the request's readout and residual state however it ends (finished, failed, aborted)."""
    try:
        async for out in outputs:
            yield out
    finally:
        for key in keys:
            hub.release(key)
        await outputs.aclose()


class Gate(Protocol):
    """What a request waits for before vLLM sees it: its residual rows (row_budget.Ticket), its
    turn under fair share (fair_share.Slot)."""

    granted: bool

    async def ready(self) -> bool: ...

    def release(self) -> None: ...


async def admitted(gate: Gate, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncGenerator[RequestOutput, None]:
    """vLLM's outputs once `gate` is granted; none if the request was cancelled while it waited
    (vLLM never saw it)."""
    try:
        if await gate.ready():
            async for out in outputs:
                yield out
    finally:
        await outputs.aclose()  # closing vLLM's generator aborts the request
