"""A command returns its exit status only once every process it started has ended: its process
group is empty the moment the status is known (salience/core/engine/start/children.py). The server's
drain, its drain timeout and a second SIGTERM are checked where those stops run (test_drain.py,
test_tls.py); here, the stops that have no server to drain: a failed start, and `salience
capture` with its engine in process."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import free_port
from tests.process_group import left_in_group
from tests.test_serve import SALIENCE


def run(command: list[str], log: Path, timeout: float = 300) -> tuple[int, list[str], str]:
    """Exit status, what was left of the group at that moment, output. The output goes to a file:
    a pipe would be held open by a process that outlived the command."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        code = process.wait(timeout)
        left = left_in_group(process.pid)
    return code, left, log.read_text()


def test_a_start_that_fails_in_the_engine_core_leaves_nothing_behind(tiny_model: Path, tmp_path: Path) -> None:
    """The engine core (forked from the fork server serve starts early) fails to place its KV
    cache: the fork server, the engine core and multiprocessing's resource tracker are all gone."""
    command = [SALIENCE, "serve", "--model", str(tiny_model), "--eager", "--max-model-len", "512", "--no-readouts"]
    command += ["--kv-cache-gib", "100000", "--lmtp-port", str(free_port()), "--no-grpc"]
    code, left, output = run(command, tmp_path / "serve.log")
    assert code == 1 and "salience: error:" in output, output
    assert "kv cache" in output.lower(), output
    assert not left, f"left running: {left}\n{output}"


def test_a_capture_with_its_engine_in_process_leaves_nothing_behind(tiny_model: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"text number {i}"}) + "\n" for i in range(3)))
    command = [SALIENCE, "capture", str(corpus), "--layers", "1", "-o", str(tmp_path / "out")]
    command += ["--model", str(tiny_model), "--eager", "--max-tokens-per-doc", "4"]
    code, left, output = run(command, tmp_path / "capture.log")
    assert code == 0, output
    assert (tmp_path / "out" / "shard-00000.safetensors").exists()
    assert not left, f"left running: {left}\n{output}"
