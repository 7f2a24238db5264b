"""The LMQL A/B: eight LMQL queries against Salience and against `lmql serve-model`, one run.

Both servers serve the default model's folder and stay up together: Salience as `salience
serve` runs it (compiled, readouts and steering on), LMQL's own server (its transformers
backend, in the LMQL environment of tools/lmql_env.py, never Salience's). The suite
(tools/lmql_suite.py, greedy queries and one score) runs in LMQL's environment against each
in turn, alternating which goes first, repeated; per query the median seconds on each and
their ratio, and whether every answer is the same on both servers and in every run.

Where the time goes: during each suite run, the CPU seconds of the LMQL client process, of
the server's own process (for Salience: aiohttp, LMTP, and vLLM's frontend: tokens in,
outputs out) and of the server's child processes (Salience's vLLM engine core: scheduler and
model). Wall time that none of them spent on a CPU is waiting: the wire, and each side
waiting for the other.

    .venv/bin/python -m tools.bench_lmql [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from tools.lmql_env import client_python

SUITE = Path(__file__).with_name("lmql_suite.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched(stack: ExitStack, name: str, command: list[str], ready, timeout: float = 1800) -> int:
    """Start a server, stop it when `stack` closes, and wait until `ready()` holds."""
    log = stack.enter_context(open(Path("/tmp") / f"bench_lmql-{name.split()[0]}.log", "w"))  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    stack.callback(lambda: (process.terminate(), process.wait(timeout=120)))
    started = time.monotonic()
    while not ready():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} (log: {log.name})")
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"{name}: not ready after {timeout:.0f} s")
        time.sleep(1)
    print(f"  {name}: ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return process.pid


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of process `pid` and of all its descendants, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    parents, used = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick

    def descends(p: int) -> bool:
        while p in parents and p > 1:
            p = parents[p]
            if p == pid:
                return True
        return False

    return used.get(pid, 0.0), sum(seconds for p, seconds in used.items() if descends(p))


def health_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    print("the LMQL environment (built once) and the default model", file=sys.stderr)
    python = client_python()
    model = ensure_default_model()
    ours, theirs = free_port(), free_port()
    servers = {
        "salience": (f"127.0.0.1:{ours}", DEFAULT_MODEL_NAME),
        "lmql serve-model": (f"127.0.0.1:{theirs}", str(model)),
    }
    times: dict[str, dict[str, list[float]]] = {name: {} for name in servers}
    # Per server and run: client CPU, the server process's CPU, its children's CPU, wall.
    spent: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in servers}
    pids: dict[str, int] = {}
    answers: dict[str, set[str]] = {}
    with ExitStack() as stack:
        print("starting both servers", file=sys.stderr)
        serve = [sys.executable, "-m", "salience", "serve", "--lmtp-port", str(ours), "--no-grpc"]
        pids["salience"] = launched(stack, "salience", serve, lambda: health_ok(ours))
        # `lmql serve-model`, by the interpreter: the environment was built elsewhere and moved
        # into place, so its console scripts name the wrong Python.
        lmql = [str(python), "-m", "lmql.cli", "serve-model", str(model), "--port", str(theirs), "--static"]
        pids["lmql serve-model"] = launched(stack, "lmql serve-model", lmql, lambda: listening(theirs))

        def suite(name: str) -> dict[str, list]:
            endpoint, served = servers[name]
            command = [str(python), str(SUITE), endpoint, served, str(model)]
            run = subprocess.run(command, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise RuntimeError(f"the suite failed against {name}:\n{run.stderr[-3000:]}")
            return json.loads(run.stdout.strip().splitlines()[-1])

        names = list(servers)
        for name in names:  # LMQL's server loads its model on the first request: not timed
            suite(name)
        for repeat in range(args.repeats):
            for name in names[repeat % 2 :] + names[: repeat % 2]:
                own, children = cpu_seconds(pids[name])
                run = suite(name)
                own_after, children_after = cpu_seconds(pids[name])
                results = run["queries"]
                wall = sum(seconds for _, seconds in results.values())
                spent[name].append((run["cpu_seconds"], own_after - own, children_after - children, wall))
                for query, (answer, seconds) in results.items():
                    times[name].setdefault(query, []).append(seconds)
                    answers.setdefault(query, set()).add(json.dumps(answer))
                print(f"  run {repeat + 1} {name:17} {wall:6.2f} s", file=sys.stderr)

    print(f"\n{DEFAULT_MODEL_NAME}, the LMQL suite one query after another, median of {args.repeats}\n")
    print("| query | salience s | lmql serve-model s | speed-up | same answer | answer |\n|---|---:|---:|---:|---|---|")
    for query in times["salience"]:
        a, b = (statistics.median(times[name][query]) for name in servers)
        same = "yes" if len(answers[query]) == 1 else "NO"
        shown = " / ".join(sorted(answers[query]))[:60].replace("|", "\\|").replace("\n", "\\n")
        print(f"| {query} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {same} | {shown} |")
    ta, tb = (sum(statistics.median(v) for v in times[name].values()) for name in servers)
    every = all(len(v) == 1 for v in answers.values())
    print(f"| **all 8** | **{ta:.2f}** | **{tb:.2f}** | **{tb / ta:.2f}x** | {'yes' if every else 'NO'} | |")
    print(
        "\nWhere a suite run's time goes (medians; wall: the eight queries; CPU seconds of each process while"
        " they ran)\n\n| server | wall s | LMQL client | server process | engine processes |"
        " waiting (wall - all CPU) |\n|---|---:|---:|---:|---:|---:|"
    )
    for name in servers:
        client, own, children, wall = (statistics.median(column) for column in zip(*spent[name], strict=True))
        waiting = max(0.0, wall - client - own - children)
        print(f"| {name} | {wall:.2f} | {client:.2f} | {own:.2f} | {children:.2f} | {waiting:.2f} |")


if __name__ == "__main__":
    main()
