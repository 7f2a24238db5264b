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

    .venv/bin/python -m tools.bench_lmql [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

if not __package__:  # run as `python tools/bench_lmql.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from salience.core.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from tools.harness import HOST, Report, Server, arguments, listens, rotations, salience_serve, say, serve
from tools.lmql_env import client_python

SUITE = Path(__file__).with_name("lmql_suite.py")
SPENT = ("client cpu", "server cpu", "engine cpu", "wall")  # per server and run: where the time went


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


def suite(python: Path, model: Path, server: Server, served: str) -> dict:
    """One run of the suite in LMQL's environment against `server`: its JSON line."""
    command = [str(python), str(SUITE), f"{HOST}:{server.port}", served, str(model)]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the suite failed against {server.name}:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    args = arguments(__doc__).parse_args()
    report = Report("bench_lmql", args)
    samples = report.samples
    say("the LMQL environment (built once) and the default model")
    python = client_python()
    model = ensure_default_model()
    answers: dict[str, set[str]] = {}
    queries: list[str] = []
    with ExitStack() as stack:
        say("starting both servers")
        ours = stack.enter_context(serve("salience", salience_serve()))
        # `lmql serve-model`, by the interpreter: the environment was built elsewhere and moved
        # into place, so its console scripts name the wrong Python. It answers once it listens.
        lmql = [str(python), "-m", "lmql.cli", "serve-model", str(model), "--port", "{port}", "--static"]
        theirs = stack.enter_context(serve("lmql serve-model", lmql, probe=listens))
        servers = {"salience": (ours, DEFAULT_MODEL_NAME), "lmql serve-model": (theirs, str(model))}
        for server, served in servers.values():  # LMQL's server loads its model on the first request: not timed
            suite(python, model, server, served)
        for _, name in rotations(list(servers), args.repeats):
            server, served = servers[name]
            own, children = cpu_seconds(server.process.pid)
            run = suite(python, model, server, served)
            own_after, children_after = cpu_seconds(server.process.pid)
            results = run["queries"]
            queries = list(results)
            wall = sum(seconds for _, seconds in results.values())
            spent = (run["cpu_seconds"], own_after - own, children_after - children, wall)
            values = {f"{name} {query}": seconds for query, (_, seconds) in results.items()}
            samples.add(
                f"{name:17} {wall:6.2f} s", values | {f"{name} {kind}": v for kind, v in zip(SPENT, spent, strict=True)}
            )
            for query, (answer, _) in results.items():
                answers.setdefault(query, set()).add(json.dumps(answer))

    names = list(servers)
    table = report.table(
        f"{DEFAULT_MODEL_NAME}, the LMQL suite one query after another, median of {args.repeats}",
        ("query", ""),
        *((f"{name} s", "{:.2f}") for name in names),
        ("speed-up", "{:.2f}x"),
        ("same answer", ""),
        ("answer", ""),
    )
    for query in queries:
        a, b = (samples.median(f"{name} {query}") for name in names)
        same = "yes" if len(answers[query]) == 1 else "NO"
        table.add(query, a, b, b / a, same, " / ".join(sorted(answers[query]))[:60])
    ta, tb = (sum(samples.median(f"{name} {query}") for query in queries) for name in names)
    every = all(len(v) == 1 for v in answers.values())
    table.add(f"all {len(queries)}", ta, tb, tb / ta, "yes" if every else "NO", "")
    where = report.table(
        "Where a suite run's time goes (medians; wall: the eight queries; CPU seconds of each process while they ran)",
        ("server", ""),
        ("wall s", "{:.2f}"),
        ("LMQL client", "{:.2f}"),
        ("server process", "{:.2f}"),
        ("engine processes", "{:.2f}"),
        ("waiting (wall - all CPU)", "{:.2f}"),
    )
    for name in names:
        client, own, children, wall = (samples.median(f"{name} {kind}") for kind in SPENT)
        where.add(name, wall, client, own, children, max(0.0, wall - client - own - children))
    report.emit()


if __name__ == "__main__":
    main()
