"""The readout hub against scripted engines: the merge across pipeline stages and DP engines, and
the frontend half of the step-output transport.

The real engines are tested in test_pipeline_parallel.py and test_data_parallel.py. This pins
down the orders the real ones produce only sometimes: one stage's rows of a step arriving a
fetch before the other's.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from salience.core.probes.readout_scheduler import PAYLOAD
from salience.core.probes.readouts import ReadoutHub
from salience.errors import EngineError

LAYERS, CONCEPTS = (0, 2, 3), ("a", "b")
SET = SimpleNamespace(layers=LAYERS, concepts=CONCEPTS, info=(), point="resid_post", hidden_size=4)


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
    hub.register("k", len(CONCEPTS))
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
    hub.register("on0", len(CONCEPTS))
    hub.register("on1", len(CONCEPTS))
    assert await hub.take("on1", [7]) == {7: pytest.approx(tuple(full))}
    assert await hub.take("on0", [1]) == {1: pytest.approx(tuple(full))}
    assert hub.origin == {"on0": 0, "on1": 1}


async def test_rows_that_come_with_the_step_outputs_are_filed_before_vllm_sees_them() -> None:
    """The step-output transport's frontend half: the hub takes its payload out of each output's
    kv_transfer_params (keeping anything else there), files the rows under the request's key and
    the engine the scheduler names, and only then hands the outputs to vLLM's processor."""
    setup = [{"shape": [64, 3, 2], "slots": [0, 1, 2]}]
    full, other = row({0: 1.0, 1: 2.0, 2: 3.0}), row({0: 4.0, 1: 5.0, 2: 6.0})
    seen = []

    def process_outputs(outputs, *args, **kwargs):
        seen.append([(o.request_id, o.kv_transfer_params, dict(hub._buffers.get("k", {}))) for o in outputs])
        return "processed"

    processor = SimpleNamespace(process_outputs=process_outputs)
    llm = SimpleNamespace(output_processor=processor)

    async def call_utility_all_async(utility, method, timeout, args, kwargs):
        assert (method, args) == ("salience_readout_setup", (True,))
        return [setup, setup]

    llm.engine_core = SimpleNamespace(call_utility_all_async=call_utility_all_async)
    hub = await ReadoutHub.install(llm, SET, engines=2, with_output=True)
    hub.register("k", len(CONCEPTS))

    def payload(engine: int, key: str, rows: dict) -> dict:
        return {PAYLOAD: {"engine": engine, "blocks": [[key, *block(rows)]]}}

    outputs = [
        SimpleNamespace(request_id="k-1", kv_transfer_params=payload(1, "k", {4: full})),
        SimpleNamespace(request_id="j-1", kv_transfer_params={"remote": 7, **payload(0, "gone", {0: other})}),
        SimpleNamespace(request_id="i-1", kv_transfer_params=None),
    ]
    assert processor.process_outputs(outputs, 0.0, None) == "processed"
    (batch,) = seen
    assert [(request_id, params) for request_id, params, _ in batch] == [
        ("k-1", None),
        ("j-1", {"remote": 7}),
        ("i-1", None),
    ]
    assert batch[0][2] == {4: pytest.approx(tuple(full))}  # filed before vLLM's processor ran
    assert await hub.take("k", [4]) == {4: pytest.approx(tuple(full))}
    assert hub.origin == {"k": 1}  # "gone" was released (never registered): its rows are dropped
    hub.release("k")
    assert hub.tracked() == 0 and hub._dropped == set()  # nothing to tell a worker: it keeps nothing
