"""The fork server's processes run in the environment of their start, as spawned ones do: the
pooled test engines start this way (tests/engines.py), `salience serve`'s spawn (test_serve.py)."""

from __future__ import annotations

import os
from multiprocessing.context import ForkServerContext

import vllm.v1.engine.utils as starter

from salience.core.engine import environment
from salience.core.engine.fork_server import forked_processes


def _report(queue, names: list[str]) -> None:
    queue.put({name: os.environ.get(name) for name in names} | {"pid": os.getpid()})


def test_a_forked_process_takes_the_environment_of_its_start() -> None:
    with forked_processes():
        context = starter.get_mp_context()
    queue = context.Queue()
    names = ["SALIENCE_FORK_TEST", "VLLM_CPU_KVCACHE_SPACE"]
    seen = []
    for value in ("1", "2"):
        with environment.scoped({"SALIENCE_FORK_TEST": value, "VLLM_CPU_KVCACHE_SPACE": value}):
            process = context.Process(target=_report, args=(queue, names))
            process.start()
        seen.append(queue.get(timeout=120))
        process.join(timeout=30)
        assert process.exitcode == 0
    assert [s["SALIENCE_FORK_TEST"] for s in seen] == ["1", "2"]
    assert [s["VLLM_CPU_KVCACHE_SPACE"] for s in seen] == ["1", "2"]
    assert os.getpid() not in {s["pid"] for s in seen}
    assert "SALIENCE_FORK_TEST" not in os.environ


def test_vllm_starts_processes_from_it_only_inside_the_block() -> None:
    original = starter.get_mp_context
    with forked_processes():
        assert isinstance(starter.get_mp_context(), ForkServerContext)
    assert starter.get_mp_context is original
    assert not isinstance(starter.get_mp_context(), ForkServerContext)
