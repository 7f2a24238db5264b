"""Inside the vLLM worker: capture residual-stream readouts with forward hooks.

Loaded by vLLM as `worker_extension_cls`; the engine drives it by name through
`collective_rpc`. Theory of operation:

- A request asks for readouts through `SamplingParams.extra_args[TAG] =
  [key, [[start, end], ...]]` (absolute positions, end exclusive).
- Hooks sit on the chosen decoder layers. The hook of the first readout layer
  maps this step's flattened token rows to requests (input_batch.req_ids and
  query_start_loc; absolute positions from runner.positions) and picks the rows
  whose positions were asked for. Every readout layer then projects just those
  rows: residual = hidden + residual (vLLM's fused add-norm output, which is the
  decoder layer's output before the final norm) times the layer's concept
  matrix, in float32. The last readout layer files one [rows, layers, concepts]
  block per request.
- Only these small blocks leave the worker, as bytes, when the engine calls
  `salience_readout_take`; it also names finished requests whose blocks to drop.
- Requests batched together never mix: rows are selected per request. Under
  tensor parallelism the residual is replicated after the all-reduce, so rank 0
  alone captures.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

TAG = "salience_readout"

__all__ = ["TAG", "ReadoutWorker"]


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    for path in ("model.layers", "language_model.model.layers", "model.language_model.layers"):
        obj: Any = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise AttributeError(f"no decoder layers found in {type(model).__name__}")


class ReadoutWorker:
    """Mixed into vLLM's worker class; methods are called through collective_rpc."""

    def salience_readout_setup(self, layers: list[int], vectors: list[bytes], hidden: int) -> list[int]:
        self._ro_store: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        if getattr(self, "rank", 0) != 0:  # the residual is replicated: rank 0 alone captures
            return []
        self._ro_layers = [int(layer) for layer in layers]
        self._ro_matrices = [
            torch.from_numpy(np.frombuffer(blob, dtype=np.float32).reshape(-1, hidden).copy()).T.contiguous()
            for blob in vectors
        ]  # each [hidden, n_concepts]
        self._ro_step: list[tuple[str, int, int]] = []  # (key, first row in selection, count)
        self._ro_rows: torch.Tensor | None = None
        self._ro_positions: np.ndarray | None = None
        self._ro_parts: list[torch.Tensor] = []
        decoder = _decoder_layers(self.model_runner.get_model())
        self._ro_handles = [
            decoder[layer].register_forward_hook(self._ro_hook(i)) for i, layer in enumerate(self._ro_layers)
        ]
        return self._ro_layers

    def salience_readout_take(self, keys: list[str], drop: list[str]) -> dict[str, list]:
        """Blocks captured since the last take, per key: [positions bytes, values bytes]."""
        for key in drop:
            self._ro_store.pop(key, None)
        taken = {}
        for key in keys:
            blocks = self._ro_store.pop(key, None)
            if blocks:
                positions = np.concatenate([b[0] for b in blocks])
                values = np.concatenate([b[1] for b in blocks])
                taken[key] = [positions.astype(np.int64).tobytes(), values.astype(np.float32).tobytes()]
        return taken

    def salience_readout_stored(self) -> int:
        return len(self._ro_store)

    # ---- the hooks ----------------------------------------------------------------

    def _ro_select(self, num_rows: int) -> None:
        runner = self.model_runner
        batch = runner.input_batch
        n = batch.num_reqs
        self._ro_step, self._ro_parts, rows = [], [], []
        if n == 0:
            self._ro_rows = None
            return
        starts = runner.query_start_loc.cpu[: n + 1].tolist()
        positions = runner.positions[:num_rows].cpu().numpy()
        picked_positions = []
        for i, request_id in enumerate(batch.req_ids[:n]):
            state = runner.requests.get(request_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
            if not extra or TAG not in extra:
                continue
            key, ranges = extra[TAG]
            s, e = starts[i], starts[i + 1]
            if e <= s:
                continue
            pos = positions[s:e]
            wanted = np.zeros(e - s, dtype=bool)
            for start, end in ranges:
                wanted |= (pos >= start) & (pos < end)
            if wanted.any():
                idx = np.nonzero(wanted)[0] + s
                self._ro_step.append((key, sum(len(r) for r in rows), len(idx)))
                rows.append(idx)
                picked_positions.append(positions[idx])
        if rows:
            self._ro_rows = torch.from_numpy(np.concatenate(rows))
            self._ro_positions = np.concatenate(picked_positions)
        else:
            self._ro_rows = None

    def _ro_hook(self, index: int):
        last = index == len(self._ro_layers) - 1

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            if isinstance(output, tuple):
                hidden, residual = output[0], output[1] if len(output) > 1 else None
            else:
                hidden, residual = output, None
            if index == 0:
                self._ro_select(hidden.shape[0])
            if self._ro_rows is None:
                return
            rows = hidden[self._ro_rows].float()
            if residual is not None:
                rows = rows + residual[self._ro_rows].float()
            self._ro_parts.append(rows @ self._ro_matrices[index])
            if last:
                block = torch.stack(self._ro_parts, dim=1).numpy()  # [rows, layers, concepts]
                for key, first, count in self._ro_step:
                    self._ro_store[key].append(
                        (self._ro_positions[first : first + count], block[first : first + count])
                    )
                self._ro_parts = []

        return hook
