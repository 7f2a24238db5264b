"""Inside the vLLM worker: file each step's readouts under the requests that asked.

Loaded by vLLM as `worker_extension_cls`; the engine sets it up by name through
`collective_rpc`. Importing this module registers the readout model loader
(taps.py), whose taps write every token's projections into one buffer
during the forward pass, compiled or eager. Theory of operation:

- A request asks for readouts through `SamplingParams.extra_args[TAG] =
  [key, [[start, end], ...], columns]` (absolute positions, end exclusive; the
  buffer columns of the concepts it reads, in its order: live.ConceptView).
- `salience_readout_setup` wraps the model runner's `_model_forward` and
  `execute_model`. Before each forward it maps the step's token rows to requests
  (input_batch.req_ids and query_start_loc; absolute positions from
  runner.positions) and picks the rows whose positions were asked for; after the
  step it copies them out of the buffer as one [rows, layers, its columns] block
  per request. Rows past the step's real tokens
  (padding) are never read. Requests batched together never mix: rows are
  selected per request.
- A request asks for its raw residual rows through `extra_args[RESIDUAL_TAG] = [key,
  ranges, slots]` (slots: the readout slots of the layers it wants): before the forward (the
  runner's `_model_forward`, wrapped) the worker names the step's rows and slots to copy
  (tap_ops.Capture), the taps' readout op copies them out at those layers, and after the step
  they are filed as [rows, its layers, hidden] blocks under that key, like readouts. A step
  nobody asked for residuals copies nothing.
- A request asks for an SAE's top features through `extra_args[FEATURE_TAG] = [key, ranges,
  SAE slot, k]`: after the step its rows' first k ids and activations are copied out of the
  features buffer (features/encoder.py) and filed as [rows, 1, 2k] blocks under that key.
- The blocks leave the worker one of two ways (docs/readouts.md, "Transport"):
  - **with the step's output** (one filing worker, synchronous scheduling: CPU
    with PP=1, any TP and DP): the runner's `sample_tokens` (or `execute_model`,
    where that returns the output) is wrapped too, and the step's blocks ride
    on its ModelRunnerOutput as the attribute ROWS, `{request id: [key,
    positions bytes, values bytes], ...]}`. The engine core's scheduler
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
- Failures. What the ops of the taps fail at, and what this code fails at while planning or
  filing, fails the requests that asked for that work in the step, never the step
  (faults.py); their rows are not filed.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from salience.core.probes.faults import taken
from salience.core.probes.step_requests import tagged
from salience.core.probes.tap_ops import Capture, Reading
from salience.core.probes.taps import (
    feature_buffer,
    readout_buffer,
    taps,
)
from salience.core.probes.warm_up import warmed_up_with

TAG = "salience_readout"
RESIDUAL_TAG = "salience_residual"
FEATURE_TAG = "salience_features"
ROWS = "salience_readout_rows"  # the ModelRunnerOutput attribute that carries a step's blocks

__all__ = ["FEATURE_TAG", "RESIDUAL_TAG", "ROWS", "TAG", "ReadoutWorker"]

Blocks = list[tuple[np.ndarray, np.ndarray]]
READ_OPS = frozenset({"readout_project", "readout_store", "residual_capture", "feature_store"})


class ReadoutWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_readout_setup(self, with_output: bool = False) -> dict | None:
        """Start filing readouts; `with_output`: send them with each step's output. Returns None
        on a TP rank > 0 (the residual is replicated there: it never files), else the buffer's
        shape, the readout slots this pipeline stage's taps write (none: the stage holds no
        readout layer and files nothing) and the SAE features buffer's shape (None without SAEs)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        # Per vLLM request id: per key it was tagged with (readouts, residuals), its blocks so far.
        self._ro_store: dict[str, dict[str, Blocks]] = {}
        self._ro_capture: list[tuple[str, str, np.ndarray]] = []  # this step's: request id, key, rows
        if get_tensor_model_parallel_rank() != 0:
            return None
        runner = self.model_runner
        model = runner.get_model()
        buffer = readout_buffer(model)
        if buffer is None:  # a pipeline stage that holds no readout layer
            return {"shape": None, "slots": []}
        self._ro_buffer = buffer
        self._ro_features = feature_buffer(model)
        self._ro_with_output = with_output
        self._ro_picks: dict[str, list] = {}  # this step's rows per tag (_ro_plan), filed after it
        self._ro_values = _host(buffer)
        self._ro_feature_values = _host(self._ro_features) if self._ro_features is not None else None
        # Per SAE slot, the features its rows hold: ids in [0, top), activations in [top, 2 * top).
        self._ro_feature_tops = {e.slot: e.width for tap in taps(model) for e in tap.encoders}
        # The layer of each readout (and residual-capture) slot and of each SAE slot: what a fault names.
        self._ro_layers = {t.readout_slot: t.site.layer for t in taps(model) if t.readout_slot is not None}
        self._ro_layers.update({t.capture_slot: t.site.layer for t in taps(model) if t.patch_slot is not None})
        self._ro_sae_layers = {e.slot: t.site.layer for t in taps(model) for e in t.encoders}
        runner.execute_model = self._ro_after(runner.execute_model, file=True, send=with_output)
        runner._model_forward = self._ro_capturing(runner._model_forward)
        if with_output:
            runner.sample_tokens = self._ro_after(runner.sample_tokens, file=False, send=True)
        slots = sorted(tap.readout_slot for tap in taps(model) if tap.readout_slot is not None)
        features = list(self._ro_features.shape) if self._ro_features is not None else None
        return {"shape": list(buffer.shape), "slots": slots, "features": features}

    def salience_readout_take(self, keys: list[str], drop: list[str]) -> dict[str, list]:
        """Blocks captured since the last take, per key: [positions bytes, values bytes]."""
        wanted, dropped = set(keys), set(drop)
        taken = {}
        for request_id, by_key in list(self._ro_store.items()):
            for key in list(by_key):
                if key in dropped:
                    del by_key[key]
                elif key in wanted:
                    taken[key] = _joined(by_key.pop(key))
            if not by_key:
                del self._ro_store[request_id]
        return taken

    def salience_concept_write(self, column: int, vectors: dict[int, bytes] | None) -> None:
        """Column `column` of every readout tap's matrix: `vectors[layer]` (float32 bytes, as
        given), or zero (None). Every rank writes (each projects)."""
        for tap in taps(self.model_runner.get_model()):
            if tap.readout_slot is None:
                continue
            vector = vectors.get(tap.site.layer) if vectors else None
            if vector is None:
                tap.matrix[:, column] = 0.0
            else:
                tap.matrix[:, column] = torch.from_numpy(np.frombuffer(vector, dtype=np.float32).copy()).to(
                    tap.matrix.device
                )

    def salience_readout_stored(self) -> int:
        return len(self._ro_store)

    def salience_readout_graph(self) -> dict:
        """What the compiler made of the model: traced graphs and graph breaks (dynamo's own
        counters, this process), how many layer taps the model holds, and the tokens of the
        compile warm-up (probes/warm_up.py; None: vLLM's own ran, or none), the threads Inductor
        compiles with (probes/compile_threads.py), and how many forwards vLLM loaded from its AOT
        artifact (probes/compile_cache.py) or traced and compiled anew."""
        import torch._inductor.config as inductor
        from torch._dynamo.utils import counters
        from vllm.compilation.counter import compilation_counter

        return {
            "taps": len(taps(self.model_runner.get_model())),
            "graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": dict(counters["graph_break"]),
            "warm_up": warmed_up_with(),
            "compile_threads": inductor.compile_threads,
            "aot": {
                "loaded": compilation_counter.num_aot_artifacts_loaded,
                "compiled": compilation_counter.num_aot_compiles,
            },
        }

    # ---- after each step -------------------------------------------------------------

    def _ro_after(self, step, *, file: bool, send: bool):
        @functools.wraps(step)
        def run(*args, **kwargs):
            result = step(*args, **kwargs)
            if file:
                try:
                    self._ro_file()
                except Exception as exc:  # not one request's: every request the step filed for fails
                    self._ft_fail(self._ro_asking(), "filing the step's readouts", exc)
            if send and self._ro_store and isinstance(result, ModelRunnerOutput):
                result = self._ro_send(result)
            return result

        return run

    def _ro_send(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Put every block filed so far on the step's output (vLLM returns one shared object for
        an empty step: that one is copied, never written)."""
        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = copy.copy(output)
        rows = {
            request_id: [[key, *_joined(blocks)] for key, blocks in by_key.items()]
            for request_id, by_key in self._ro_store.items()
        }
        setattr(output, ROWS, rows)
        self._ro_store = {}
        return output

    def _ro_capturing(self, model_forward):
        @functools.wraps(model_forward)
        def run(*args, **kwargs):
            try:
                self._ro_plan()
            except Exception as exc:  # not one request's: every request asking for rows fails
                self._ro_picks, self._ro_capture, Capture.rows, Reading.columns = {}, [], None, 0
                self._ft_fail(self._ro_asking(), "planning the step's readouts", exc)
            try:
                return model_forward(*args, **kwargs)
            finally:
                Reading.columns = 0
                self._ro_faulted()
                if Capture.rows is not None:
                    try:
                        self._ro_file_capture()
                    except Exception as exc:
                        Capture.rows, Capture.taken = None, {}
                        self._ft_fail([r for r, *_ in self._ro_capture], "filing the step's residual rows", exc)
                        self._ro_capture = []

        return run

    def _ro_asking(self) -> list[str]:
        """This step's requests asking for readouts, residual rows or features."""
        tags = (TAG, RESIDUAL_TAG, FEATURE_TAG)
        return list(dict.fromkeys(request_id for tag in tags for _, request_id, _ in tagged(self.model_runner, tag)))

    def _ro_faulted(self) -> None:
        """Fail the requests whose rows an op of the forward failed to write: every request reading
        concepts for a projection (a row holds every read layer), those asking rows at its layer for
        a capture, an SAE's features for its store."""
        for op, slot, exc in taken(READ_OPS):
            if op == "residual_capture":
                asking = [r for r, (_, _, slots), _, _ in self._ro_capture if slot in slots]
                layer = self._ro_layers[slot]
            elif op == "feature_store":
                asking = [r for r, extra, _, _ in self._ro_picks.get(FEATURE_TAG, ()) if extra[FEATURE_TAG][2] == slot]
                layer = self._ro_sae_layers[slot]
            else:
                asking = [r for r, _, _, _ in self._ro_picks.get(TAG, ())]
                layer = self._ro_layers[slot]
            self._ft_fail(asking, f"salience::{op} at layer {layer}", exc)

    def _ro_plan(self) -> None:
        """Before the forward, which rows each request reads this step, and so the readout columns
        the taps project (tap_ops.Reading: past the last one a request reading this step reads, 0 if
        none does). Planned here, the filing after the forward only copies: the runner's batch is
        still in the cache here and evicted by the forward after it (planned after it, at one stream
        the plan cost 120 us of a 30 ms step, measured)."""
        self._ro_plan_capture()
        self._ro_picks = {TAG: self._ro_rows(TAG)}
        if self._ro_features is not None:
            self._ro_picks[FEATURE_TAG] = self._ro_rows(FEATURE_TAG)
        Reading.columns = max((max(extra[TAG][2], default=-1) + 1 for _, extra, _, _ in self._ro_picks[TAG]), default=0)

    def _ro_plan_capture(self) -> None:
        picks = [
            (request_id, extra[RESIDUAL_TAG], rows, at) for request_id, extra, rows, at in self._ro_rows(RESIDUAL_TAG)
        ]
        self._ro_capture = picks
        if picks:
            rows = np.concatenate([rows for _, _, rows, _ in picks])
            Capture.taken = {}
            Capture.slots = frozenset(slot for _, (_, _, slots), _, _ in picks for slot in slots)
            Capture.rows = torch.from_numpy(rows).to(self._ro_buffer.device)

    def _ro_file_capture(self) -> None:
        copied, Capture.rows, Capture.taken = Capture.taken, None, {}
        held = sorted(copied)
        # [rows, slots held, hidden]; none held: every capture failed, and so every request asking
        values = torch.stack([copied[slot] for slot in held], dim=1).numpy() if held else None
        first = 0
        for request_id, (key, _, slots), rows, at in self._ro_capture:
            mine, first = slice(first, first + len(rows)), first + len(rows)
            if request_id in self._ft_failed:
                continue
            try:
                block = values[mine]
                if list(slots) != held:
                    block = block[:, [held.index(slot) for slot in slots]]
            except Exception as exc:
                self._ft_fail([request_id], "filing residual rows", exc)
                continue
            self._ro_store.setdefault(request_id, {}).setdefault(key, []).append((at, block))
        self._ro_capture = []

    def _ro_rows(self, tag: str) -> list[tuple[str, dict, np.ndarray, np.ndarray]]:
        """This step's requests tagged `tag` ([key, ranges, ...]), each with the step rows (indices)
        whose absolute positions its ranges cover, and those positions; requests with no such row
        are left out."""
        runner = self.model_runner
        n = runner.input_batch.num_reqs
        out: list[tuple[str, dict, np.ndarray, np.ndarray]] = []
        starts = None
        for i, request_id, extra in tagged(self.model_runner, tag):
            if starts is None:
                starts = runner.query_start_loc.cpu[: n + 1].tolist()
                # A copy: blocks hold views of it, and may wait for a fetch past the next step,
                # which rewrites the runner's positions.
                positions = runner.positions[: starts[n]].cpu().numpy().copy()
                at = positions.tolist()
                rows = np.arange(starts[n])
            s, e = starts[i], starts[i + 1]
            try:
                if e - s == 1:  # a decode step's one row, compared as numbers (most steps' every row)
                    if any(start <= at[s] < end for start, end in extra[tag][1]):
                        out.append((request_id, extra, rows[s:e], positions[s:e]))
                    continue
                if e <= s:
                    continue
                pos = positions[s:e]
                wanted = np.zeros(e - s, dtype=bool)
                for start, end in extra[tag][1]:
                    wanted |= (pos >= start) & (pos < end)
            except Exception as exc:  # its tag: it alone fails
                self._ft_fail([request_id], f"picking the rows {tag} asks for", exc)
                continue
            if wanted.any():
                out.append((request_id, extra, np.nonzero(wanted)[0] + s, pos[wanted]))
        return out

    def _ro_file(self) -> None:
        """File the rows the step's plan picked (none: the step ran no forward)."""
        picks, self._ro_picks = self._ro_picks, {}
        if picks.get(TAG):
            self._ro_file_from(TAG, picks[TAG], self._ro_values, self._ro_readouts)
        if picks.get(FEATURE_TAG):
            self._ro_file_from(FEATURE_TAG, picks[FEATURE_TAG], self._ro_feature_values, self._ro_top_features)

    def _ro_readouts(self, tag: list, rows: np.ndarray) -> np.ndarray:
        """The request's columns of its rows: a view where they are the first n (the loaded set,
        or it and live concepts in the order defined), else a copy."""
        _, _, columns = tag
        if columns == list(range(len(columns))):
            return rows[:, :, : len(columns)]
        return rows[:, :, columns]

    def _ro_top_features(self, tag: list, rows: np.ndarray) -> np.ndarray:
        _, _, slot, k = tag
        top = self._ro_feature_tops[slot]
        return np.concatenate([rows[:, slot, :k], rows[:, slot, top : top + k]], axis=1)[:, None]

    def _ro_file_from(self, tag: str, picks: list, buffer: torch.Tensor | np.ndarray, select) -> None:
        """File the picked rows of `buffer` for the requests tagged `tag`, each request's rows as
        `select(its tag, its rows)` makes them."""
        rows = np.concatenate([idx for _, _, idx, _ in picks]) if len(picks) > 1 else picks[0][2]
        block = _taken(buffer, rows, copy=not self._ro_with_output)
        first = 0
        for request_id, extra, idx, at in picks:
            theirs, first = block[first : first + len(idx)], first + len(idx)
            if request_id in self._ft_failed:
                continue
            try:
                mine = select(extra[tag], theirs)
            except Exception as exc:  # its tag: it alone fails
                self._ft_fail([request_id], f"filing the rows {tag} asks for", exc)
                continue
            self._ro_store.setdefault(request_id, {}).setdefault(extra[tag][0], []).append((at, mine))


def _host(buffer: torch.Tensor) -> torch.Tensor | np.ndarray:
    """The buffer as the filing reads it: on CPU its numpy view (the same memory), else itself."""
    return buffer.numpy() if buffer.device.type == "cpu" else buffer


def _taken(buffer: torch.Tensor | np.ndarray, rows: np.ndarray, copy: bool) -> np.ndarray:
    """buffer[rows] on the host (`rows` ascending). On CPU `buffer` is the buffer's numpy view,
    and a run of rows (a decode step's usual) is one slice: a tensor gather cost more than the rest
    of the filing (measured). The next forward rewrites the buffer: a slice is copied unless the
    blocks leave with this step's output (`copy` False), which copies them into its message."""
    if isinstance(buffer, torch.Tensor):
        return buffer[torch.from_numpy(rows).to(buffer.device)].cpu().numpy()
    if rows[-1] - rows[0] + 1 == len(rows):
        run = buffer[rows[0] : rows[-1] + 1]
        return run.copy() if copy else run
    return buffer[rows]


def _joined(blocks: Blocks) -> list[bytes]:
    if len(blocks) == 1:  # a step's, sent with its output
        ((positions, values),) = blocks
    else:
        positions, values = np.concatenate([b[0] for b in blocks]), np.concatenate([b[1] for b in blocks])
    return [positions.astype(np.int64, copy=False).tobytes(), values.astype(np.float32, copy=False).tobytes()]
