"""The readout hub's merge across pipeline stages and DP engines, against scripted worker answers.

The real engines are tested in test_pipeline_parallel.py and test_data_parallel.py. This pins
down the orders the real ones produce only sometimes: one stage's rows of a step arriving a
fetch before the other's.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from salience.core.probes.readouts import ReadoutHub
from salience.errors import EngineError

LAYERS, CONCEPTS = (0, 2, 3), ("a", "b")
SET = SimpleNamespace(layers=LAYERS, concepts=CONCEPTS, manifest={})


def block(rows: dict[int, list[float]]) -> list[bytes]:
    positions = np.array(list(rows), dtype=np.int64)
    values = np.array(list(rows.values()), dtype=np.float32)
    return [positions.tobytes(), values.tobytes()]


def row(stage_values: dict[int, float]) -> list[float]:
    """A full-width row: `value` in every entry of the given slots, zeros elsewhere."""
    out = np.zeros((len(LAYERS), len(CONCEPTS)), dtype=np.float32)
    for slot, value in stage_values.items():
        out[slot] = value
    return out.reshape(-1).tolist()


class ScriptedLLM:
    """collective_rpc answers, one list per call (per worker, in rank order)."""

    def __init__(self, takes: list[list[dict]], setup: list) -> None:
        self.takes = deque(takes)
        self.setup = setup

    async def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):
        if method == "salience_readout_setup":
            return self.setup
        assert method == "salience_readout_take"
        return self.takes.popleft() if self.takes else [{} for _ in self.setup]


# PP=2 x TP=2: workers 0, 1 are stage 0 (rank 1 files nothing), 2, 3 stage 1.
SETUP = [
    {"shape": [64, 3, 2], "slots": [0]},
    None,
    {"shape": [64, 3, 2], "slots": [1, 2]},
    None,
]


async def test_a_position_waits_for_every_stage() -> None:
    takes = [
        # Stage 0 ran steps for positions 5 and 6; stage 1 only for 5.
        [{"k": block({5: row({0: 1.0}), 6: row({0: 2.0})})}, {}, {"k": block({5: row({1: 3.0, 2: 4.0})})}, {}],
        [{}, {}, {"k": block({6: row({1: 5.0, 2: 6.0})})}, {}],
    ]
    hub = await ReadoutHub.install(ScriptedLLM(takes, SETUP), SET)
    hub.register("k")
    first = await hub.take("k", [5])
    assert first == {5: pytest.approx(tuple(row({0: 1.0, 1: 3.0, 2: 4.0})))}
    assert hub._buffers["k"] == {} and list(hub._partial["k"]) == [6]  # 6 is half there: not handed out
    second = await hub.take("k", [6])
    assert second == {6: pytest.approx(tuple(row({0: 2.0, 1: 5.0, 2: 6.0})))}
    hub.release("k")
    assert hub.tracked() == 0 and "k" not in hub._partial


async def test_stages_must_cover_every_readout_layer() -> None:
    setup = [{"shape": [64, 3, 2], "slots": [0]}, {"shape": None, "slots": []}]
    with pytest.raises(EngineError, match=r"hold slots \[0\] of 3"):
        await ReadoutHub.install(ScriptedLLM([], setup), SET)


async def test_each_dp_engine_is_read() -> None:
    """vLLM's DP client returns only the first engine's answer to collective_rpc: the hub asks
    every engine, and a request's readouts come from the engine that ran it."""
    setup = [{"shape": [64, 3, 2], "slots": [0, 1, 2]}]
    full = row({0: 1.0, 1: 2.0, 2: 3.0})
    answers = {
        "salience_readout_setup": [setup, setup],
        "salience_readout_take": [[{"on0": block({1: full})}], [{"on1": block({7: full})}]],
    }

    async def call_utility_all_async(utility, method, timeout, args, kwargs):
        assert utility == "collective_rpc"
        return answers[method]

    llm = SimpleNamespace(engine_core=SimpleNamespace(call_utility_all_async=call_utility_all_async))
    hub = await ReadoutHub.install(llm, SET, engines=2)
    hub.register("on0")
    hub.register("on1")
    assert await hub.take("on1", [7]) == {7: pytest.approx(tuple(full))}
    assert await hub.take("on0", [1]) == {1: pytest.approx(tuple(full))}
    assert hub.origin == {"on0": 0, "on1": 1}
