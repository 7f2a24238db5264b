"""The fork server's processes run in the environment of their start, as spawned ones do: the
pooled test engines start this way (tests/engines.py), and `salience serve`'s (test_drain.py)."""

from __future__ import annotations

import os
from multiprocessing.context import ForkServerContext, SpawnContext

import pytest
import setproctitle
import vllm.v1.engine.utils as starter

from salience.core.engine.start import environment, fork_server
from salience.core.engine.start.fork_server import forked_processes


def _report(queue, names: list[str]) -> None:
    setproctitle.setproctitle("VLLM::Test")  # as vLLM names its processes
    seen = {name: os.environ.get(name) for name in names}
    queue.put(seen | {"pid": os.getpid(), "starter": fork_server.starter(), "title": setproctitle.getproctitle()})


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
    assert [s["starter"] for s in seen] == [os.getpid()] * 2, "the orphan watch needs who started it"
    assert [s["title"] for s in seen] == ["VLLM::Test"] * 2
    assert "SALIENCE_FORK_TEST" not in os.environ


def test_vllm_starts_processes_from_it_only_inside_the_block() -> None:
    original = starter.get_mp_context
    with forked_processes():
        assert isinstance(starter.get_mp_context(), ForkServerContext)
    assert starter.get_mp_context is original
    assert not isinstance(starter.get_mp_context(), ForkServerContext)


def test_where_the_environment_moved_since_it_started_processes_are_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the fork server read at its start (the loader's preloads, inductor's settings) is
    not what a forked process would get, so a process started in another one is spawned."""
    with environment.scoped({"LD_PRELOAD": "/lib/libgomp.so.1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}):
        monkeypatch.setattr(fork_server, "_started_in", fork_server._fixed(os.environ))
        assert isinstance(fork_server._context(), ForkServerContext)
        with environment.scoped({"SALIENCE_FORK_TEST": "1"}):  # read by each process: forked
            assert isinstance(fork_server._context(), ForkServerContext)
        for moved in ({"LD_PRELOAD": None}, {"TORCHINDUCTOR_COMPILE_THREADS": "2"}, {"TORCHINDUCTOR_X": "1"}):
            with environment.scoped(moved):
                assert isinstance(fork_server._context(), SpawnContext), moved
