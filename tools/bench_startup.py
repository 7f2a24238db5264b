"""How long `salience serve` takes to start, for the configurations a user can pick, in one run.

Each configuration is started, timed and stopped in turn, rotating which goes first in each
round, so a neighbour's load or a warming page cache hits every one alike. Two times per start:
until the LMTP port accepts connections (the server's own imports and set-up: it listens before
the engine is up) and until `GET /health` answers 200 (the engine loaded, compiled, warmed up).

- `default`: compiled, readouts and steering on (what `salience serve` runs);
- `fastest`: compiled, `--no-readouts --no-steering` (a user who needs neither);
- `eager`: `--eager` (no compile at all);
- `spawned`, `eager-spawned`: the default and `--eager` with `--no-fork-server`: vLLM's
  engine core spawned, importing torch and vLLM after the server has, rather than forked from a
  fork server that imports them beside the server;
- `traced`: the default with `VLLM_USE_AOT_COMPILE=0`, vLLM's older compile cache only: the
  forward is traced again at every start (what every warm start did before
  probes/compile_cache.py).

With `--cold`, each configuration first starts once on a fresh `$SALIENCE_HOME` (a temporary
folder: no converted model, no compile caches, nothing built): what a newcomer's first
`make serve` waits for once setup is done, conversion included. Then, on the first of those
homes, `salience concepts build` of the default spec is timed (the build a first start runs only
where the shipped set does not fit the model). Warm starts share one home, built once.

    .venv/bin/python -m tools.bench_startup [--repeats 3] [--configs default,fastest,eager,traced] [--cold]
        [--json PATH]
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if not __package__:  # run as `python tools/bench_startup.py`: the checkout is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import salience
from tools.harness import Report, Server, arguments, fresh_caches, rotations, salience_serve, say, serve

DEFAULT_SPEC = Path(salience.__file__).parent / "concept_specs" / "default.yaml"
CONFIGS = {  # key: (description, flags, environment)
    "default": ("default: compiled, readouts + steering", [], {}),
    "fastest": ("compiled, --no-readouts --no-steering", ["--no-readouts", "--no-steering"], {}),
    "eager": ("--eager", ["--eager"], {}),
    "traced": ("default, traced every start (no AOT artifact)", [], {"VLLM_USE_AOT_COMPILE": "0"}),
    "spawned": ("default, `--no-fork-server`", ["--no-fork-server"], {}),
    "eager-spawned": ("`--eager --no-fork-server`", ["--eager", "--no-fork-server"], {}),
}


@dataclass(frozen=True)
class Config:
    key: str
    name: str
    flags: list[str]
    env: dict[str, str]


def start_once(config: Config, env: dict[str, str]) -> Server:
    """Start the server, time it to listening and to ready (polled every 50 ms), then stop it."""
    with serve(config.key, salience_serve(*config.flags), env=env, poll=0.05, quiet=True) as server:
        return server


def time_build(env: dict[str, str]) -> float:
    """Seconds `salience concepts build` takes on the default spec, in `env` (model converted)."""
    with tempfile.TemporaryDirectory(prefix="bench_startup-build-") as out:
        command = [
            sys.executable,
            "-m",
            "salience",
            "concepts",
            "build",
            str(DEFAULT_SPEC),
            "-o",
            f"{out}/c.safetensors",
        ]
        began = time.monotonic()
        subprocess.run(command, env=os.environ | env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return time.monotonic() - began


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--configs", default="default,fastest,eager,traced")
    parser.add_argument("--cold", action="store_true", help="first start each with empty compile caches")
    args = parser.parse_args()
    keys = args.configs.split(",")
    if unknown := [key for key in keys if key not in CONFIGS]:
        parser.error(f"unknown configurations {unknown}; known: {list(CONFIGS)}")
    configs = [Config(key, *CONFIGS[key]) for key in keys]
    report = Report("bench_startup", args)
    samples = report.samples

    cold: dict[str, float] = {}
    if args.cold:
        with contextlib.ExitStack() as homes:
            for config in configs:
                home = homes.enter_context(tempfile.TemporaryDirectory(prefix="bench_startup-home-"))
                fresh = {"SALIENCE_HOME": home, **fresh_caches(home)}
                cold[config.key] = start_once(config, config.env | fresh).ready
                samples.series[f"{config.key} first start"] = [cold[config.key]]
                say(f"  {config.key}: first start {cold[config.key]:.1f} s")
                if len(cold) == 1:
                    build = time_build({"SALIENCE_HOME": home, **fresh_caches(home)})
                    samples.series["concepts build"] = [build]
                    say(f"  salience concepts build (default spec): {build:.1f} s")
    # One untimed start each: it fills the compile caches when --cold did not.
    for config in configs:
        start_once(config, config.env)
    for _, config in rotations(configs, args.repeats):
        timed = start_once(config, config.env)
        samples.add(
            f"{config.key} listening in {timed.listening:.1f} s, ready in {timed.ready:.1f} s",
            {f"{config.key} listening": timed.listening, f"{config.key} ready": timed.ready},
        )

    columns = [("configuration", ""), ("listening s", "{:.1f}"), ("ready s", "{:.1f}"), ("runs", "")]
    columns += [(f"ready / {keys[0]}", "{:.2f}")] + ([("first start s", "{:.0f}")] if cold else [])
    table = report.table(
        f"warm starts, median of {args.repeats} (listening: the port accepts; ready: /health 200)", *columns
    )
    base = samples.median(f"{keys[0]} ready")
    for config in configs:
        ready = samples.median(f"{config.key} ready")
        runs = ", ".join(f"{r:.1f}" for r in samples.series[f"{config.key} ready"])
        first = [cold[config.key]] if cold else []
        table.add(config.name, samples.median(f"{config.key} listening"), ready, runs, ready / base, *first)
    if cold:
        report.text(
            f"`salience concepts build` of the default spec, first run: {samples.series['concepts build'][0]:.0f} s"
        )
    report.emit()


if __name__ == "__main__":
    main()
