"""Inside the vLLM worker: file each step's readouts under the requests that asked.

Loaded by vLLM as `worker_extension_cls`; the engine sets it up by name through
`collective_rpc`. Importing this module registers the readout model loader
(taps.py), whose taps write every token's projections into one buffer
during the forward pass, compiled or eager. Theory of operation:

- A request asks for readouts through `SamplingParams.extra_args[TAG] =
  [key, [[start, end], ...]]` (absolute positions, end exclusive).
- `salience_readout_setup` wraps the model runner's `execute_model`. After each
  step it maps the step's token rows to requests (input_batch.req_ids and
  query_start_loc; absolute positions from runner.positions), picks the rows
  whose positions were asked for, and copies them out of the buffer as one
  [rows, layers, concepts] block per request. Rows past the step's real tokens
  (padding) are never read. Requests batched together never mix: rows are
  selected per request.
- The blocks leave the worker one of two ways (docs/readouts.md, "Transport"):
  - **with the step's output** (one filing worker, synchronous scheduling: CPU
    with PP=1, any TP and DP): the runner's `sample_tokens` (or `execute_model`,
    where that returns the output) is wrapped too, and the step's blocks ride
    on its ModelRunnerOutput as the attribute ROWS, `{request id: [key,
    positions bytes, values bytes]}`. The engine core's scheduler
    (readout_scheduler.py) moves them into that request's EngineCoreOutput. No
    extra message, no extra round trip.
  - **fetched** (pipeline parallelism): blocks wait here until the engine calls
    `salience_readout_take`, which also names finished keys whose blocks to drop.
- Parallel layouts. Under tensor parallelism the residual is replicated after
  the all-reduce, so the TP-rank-0 worker of each pipeline stage alone files
  blocks (it is also the worker whose output vLLM returns). Under pipeline
  parallelism each stage holds some decoder layers, so each stage's TP-rank-0
  worker files blocks holding its own readout slots and zeros in the others;
  setup tells the engine which slots each filing worker holds, and the engine
  merges a position once every filing stage has sent it (readouts.py). Only
  these projected floats leave a stage.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from salience.core.probes.taps import readout_buffer, taps

TAG = "salience_readout"
ROWS = "salience_readout_rows"  # the ModelRunnerOutput attribute that carries a step's blocks

__all__ = ["ROWS", "TAG", "ReadoutWorker"]

Blocks = list[tuple[np.ndarray, np.ndarray]]


class ReadoutWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_readout_setup(self, with_output: bool = False) -> dict | None:
        """Start filing readouts; `with_output`: send them with each step's output. Returns None
        on a TP rank > 0 (the residual is replicated there: it never files), else the buffer's
        shape and the readout slots this pipeline stage's taps write (none: the stage holds no
        readout layer and files nothing)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        # Per vLLM request id: the key the request was tagged with, and its blocks so far.
        self._ro_store: dict[str, tuple[str, Blocks]] = {}
        if get_tensor_model_parallel_rank() != 0:
            return None
        runner = self.model_runner
        model = runner.get_model()
        buffer = readout_buffer(model)
        if buffer is None:  # a pipeline stage that holds no readout layer
            return {"shape": None, "slots": []}
        self._ro_buffer = buffer
        runner.execute_model = self._ro_after(runner.execute_model, file=True, send=with_output)
        if with_output:
            runner.sample_tokens = self._ro_after(runner.sample_tokens, file=False, send=True)
        slots = sorted(tap.readout_slot for tap in taps(model) if tap.readout_slot is not None)
        return {"shape": list(buffer.shape), "slots": slots}

    def salience_readout_take(self, keys: list[str], drop: list[str]) -> dict[str, list]:
        """Blocks captured since the last take, per key: [positions bytes, values bytes]."""
        wanted, dropped = set(keys), set(drop)
        taken = {}
        for request_id, (key, blocks) in list(self._ro_store.items()):
            if key in dropped:
                del self._ro_store[request_id]
            elif key in wanted:
                del self._ro_store[request_id]
                taken[key] = _joined(blocks)
        return taken

    def salience_readout_stored(self) -> int:
        return len(self._ro_store)

    def salience_readout_graph(self) -> dict:
        """What the compiler made of the model: traced graphs and graph breaks (dynamo's own
        counters, this process), and how many layer taps the model holds."""
        from torch._dynamo.utils import counters

        return {
            "taps": len(taps(self.model_runner.get_model())),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": dict(counters["graph_break"]),
        }

    # ---- after each step -------------------------------------------------------------

    def _ro_after(self, step, *, file: bool, send: bool):
        @functools.wraps(step)
        def run(*args, **kwargs):
            result = step(*args, **kwargs)
            if file:
                self._ro_file()
            if send and self._ro_store and isinstance(result, ModelRunnerOutput):
                result = self._ro_send(result)
            return result

        return run

    def _ro_send(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Put every block filed so far on the step's output (vLLM returns one shared object for
        an empty step: that one is copied, never written)."""
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = copy.copy(output)
        rows = {request_id: [key, *_joined(blocks)] for request_id, (key, blocks) in self._ro_store.items()}
        setattr(output, ROWS, rows)
        self._ro_store = {}
        return output

    def _ro_file(self) -> None:
        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        if n == 0:
            return
        starts = runner.query_start_loc.cpu[: n + 1].tolist()
        positions = None
        picks: list[tuple[str, str, np.ndarray]] = []
        for i, request_id in enumerate(batch.req_ids[:n]):
            state = runner.requests.get(request_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if not extra or TAG not in extra:
                continue
            s, e = starts[i], starts[i + 1]
            if e <= s:
                continue
            if positions is None:
                positions = runner.positions[: starts[n]].cpu().numpy()
            key, ranges = extra[TAG]
            pos = positions[s:e]
            wanted = np.zeros(e - s, dtype=bool)
            for start, end in ranges:
                wanted |= (pos >= start) & (pos < end)
            if wanted.any():
                picks.append((request_id, key, np.nonzero(wanted)[0] + s))
        if not picks:
            return
        rows = np.concatenate([idx for _, _, idx in picks])
        block = self._ro_buffer[torch.from_numpy(rows).to(self._ro_buffer.device)].cpu().numpy()
        first = 0
        for request_id, key, idx in picks:
            blocks = self._ro_store.setdefault(request_id, (key, []))[1]
            blocks.append((positions[idx], block[first : first + len(idx)]))
            first += len(idx)


def _joined(blocks: Blocks) -> list[bytes]:
    positions = np.concatenate([b[0] for b in blocks]).astype(np.int64)
    values = np.concatenate([b[1] for b in blocks]).astype(np.float32)
    return [positions.tobytes(), values.tobytes()]
