"""How long `salience serve` takes to start, for the configurations a user can pick, in one run.

Each configuration is started, timed and stopped in turn, rotating which goes first in each
round, so a neighbour's load or a warming page cache hits every one alike. Two times per start:
until the LMTP port accepts connections (the server's own imports and set-up: it listens before
the engine is up) and until `GET /health` answers 200 (the engine loaded, compiled, warmed up).

- `default`: compiled, readouts and steering on (what `salience serve` runs);
- `fastest`: compiled, `--no-readouts --no-steering` (a user who needs neither);
- `eager`: `--eager` (no compile at all);
- `traced`: the default with `VLLM_USE_AOT_COMPILE=0`, vLLM's older compile cache only: the
  forward is traced again at every start (what every warm start did before
  probes/compile_cache.py).

With `--cold`, each configuration first starts once with empty compile caches (a temporary
VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR): what a first start compiles. The model's
conversion and the concept set are built once per SALIENCE_HOME and are not in either time.

    .venv/bin/python -m tools.bench_startup [--repeats 3] [--configs default,fastest,eager,traced] [--cold]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from tools.bench_lmql import free_port, health_ok, listening

CONFIGS = {  # key: (description, flags, environment)
    "default": ("default: compiled, readouts + steering", [], {}),
    "fastest": ("compiled, --no-readouts --no-steering", ["--no-readouts", "--no-steering"], {}),
    "eager": ("--eager", ["--eager"], {}),
    "traced": ("default, traced every start (no AOT artifact)", [], {"VLLM_USE_AOT_COMPILE": "0"}),
}


@dataclass
class Config:
    key: str
    name: str
    flags: list[str]
    env: dict[str, str]
    listening: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Start:
    listening: float
    ready: float


def start_once(config: Config, env: dict[str, str], timeout: float = 1800) -> Start:
    """Start the server, time it to listening and to ready, then stop it (SIGTERM, waited for)."""
    port = free_port()
    command = [sys.executable, "-m", "salience", "serve", "--lmtp-port", str(port), "--no-grpc", *config.flags]
    with tempfile.NamedTemporaryFile("w", prefix=f"bench_startup-{config.key}-", suffix=".log", delete=False) as log:
        began = time.monotonic()
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | env)
    heard = None
    last = began
    try:
        while True:
            now = time.monotonic()
            if process.poll() is not None:
                raise RuntimeError(f"{config.key}: the server exited with {process.returncode} (log: {log.name})")
            if now - began > timeout:
                raise TimeoutError(f"{config.key}: not ready after {timeout:.0f} s (log: {log.name})")
            if heard is None and listening(port):
                heard = now - began
            if heard is not None and health_ok(port):
                ready = time.monotonic() - began
                break
            if now - last > 30:
                last = now
                print(f"    {config.key}: starting, {now - began:.0f} s so far", file=sys.stderr)
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    os.unlink(log.name)
    return Start(heard, ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default="default,fastest,eager,traced")
    parser.add_argument("--cold", action="store_true", help="first start each with empty compile caches")
    args = parser.parse_args()
    keys = args.configs.split(",")
    unknown = [key for key in keys if key not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    configs = [Config(key, *CONFIGS[key]) for key in keys]

    cold: dict[str, Start] = {}
    if args.cold:
        for config in configs:
            with tempfile.TemporaryDirectory(prefix="bench_startup-cache-") as cache:
                fresh = {"VLLM_CACHE_ROOT": f"{cache}/vllm", "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor"}
                cold[config.key] = start_once(config, config.env | fresh)
            print(f"  {config.key}: first start {cold[config.key].ready:.1f} s", file=sys.stderr)
    # One untimed start each: it fills the compile caches when --cold did not.
    for config in configs:
        start_once(config, config.env)
    for round_ in range(args.repeats):
        shift = round_ % len(configs)
        for config in configs[shift:] + configs[:shift]:
            timed = start_once(config, config.env)
            config.listening.append(timed.listening)
            config.ready.append(timed.ready)
            print(f"  round {round_ + 1}: {config.key} ready in {timed.ready:.1f} s", file=sys.stderr)

    base = statistics.median(configs[0].ready)
    print(f"\nwarm starts, median of {args.repeats} (listening: the port accepts; ready: /health 200)\n")
    first = " first start |" if cold else ""
    print(f"| configuration | listening | ready | runs | ready / {configs[0].key} |{first}")
    print("|---|---:|---:|---|---:|" + ("---:|" if cold else ""))
    for config in configs:
        ready, heard = statistics.median(config.ready), statistics.median(config.listening)
        runs = ", ".join(f"{r:.1f}" for r in config.ready)
        row = f"| {config.name} | {heard:.1f} s | {ready:.1f} s | {runs} | {ready / base:.2f} |"
        print(row + (f" {cold[config.key].ready:.0f} s |" if cold else ""))


if __name__ == "__main__":
    main()
