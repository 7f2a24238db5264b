"""The report of a run: tables, time to first token, the server's resources, and what failed."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from tools.soak.options import MIB, SoakOptions
from tools.soak.server import IDLE_METRICS, Sample, Server
from tools.soak.state import Model
from tools.soak.tally import StreamTally, Tally


@dataclass
class SoakReport:
    options: SoakOptions
    server: Server
    model: Model
    tally: Tally
    samples: list[Sample]
    seconds: float
    server_exit: int | None = 0
    server_died: bool = False
    exit_seconds: float = 0.0  # from SIGTERM to exit
    leftovers: dict[str, float] | None = None  # IDLE_METRICS not back to zero; None: no /metrics

    def failures(self) -> list[str]:
        tally, out = self.tally, []
        if tally.lost:
            out.append(f"{tally.lost} streams lost")
        if tally.wrong:
            out.append(f"{tally.wrong} bad inputs without their specific error")
        if tally.dropped_connections:
            out.append(f"{tally.dropped_connections} connections dropped by the server")
        if tally.strays:
            out.append(f"{tally.strays} payloads for streams that were not running")
        if tally.tool_errors:
            out.append(f"{tally.tool_errors} jobs failed with an exception")
        if self.leftovers and self.server.process is not None:  # an attached server may have other clients
            out.append(f"still held after the load: {self.leftovers}")
        if self.server_died:
            out.append("the server died during the run")
        if self.server_exit != 0:
            out.append(f"the server's exit after SIGTERM: {self.server_exit}")
        return out

    def render(self) -> str:
        o, tally = self.options, self.tally
        where = "started" if self.server.process else "attached"
        out = [
            f"soak: {self.seconds:.0f} s against {self.model.name} ({where}, pid {self.server.pid}), "
            f"{o.connections} connections x {o.streams} streams, {o.sessions} gRPC session workers, "
            f"{o.tokens} tokens a stream, messages limited to {self.server.max_message_bytes} bytes "
            f"(frames to {self.server.max_frame_bytes or 'unknown'})",
            "",
            f"{'streams':24} {'started':>8} {'completed':>10} {'lost':>6} {'tokens':>8}",
        ]
        for kind in sorted(tally.streams):
            t = tally.streams[kind]
            out.append(f"{kind:24} {t.started:>8} {t.completed:>10} {t.lost:>6} {t.tokens:>8}")
        total = StreamTally(
            *(sum(getattr(t, f) for t in tally.streams.values()) for f in ("started", "completed", "lost", "tokens"))
        )
        out.append(f"{'total':24} {total.started:>8} {total.completed:>10} {total.lost:>6} {total.tokens:>8}")
        out.append(f"{'':24} {total.tokens / self.seconds:>36.1f} tokens/s")
        out += ["", f"{'bad inputs':24} {'sent':>8} {'specific':>10} {'wrong':>6} {'no answer':>10}"]
        for kind in sorted(tally.faults):
            t = tally.faults[kind]
            out.append(f"{kind:24} {t.sent:>8} {t.specific:>10} {t.wrong:>6} {t.unanswered:>10}")
        out.append(f"errors on valid streams: {sum(tally.unexpected.values())}")
        out += [f"  {n:>5} x {message}" for message, n in tally.unexpected.most_common(10)]
        out += ["", self.ttft_line(), *self.resource_lines()]
        idle = "no /metrics" if self.leftovers is None else (self.leftovers or "all zero")
        out.append(f"after the load, /metrics {', '.join(IDLE_METRICS)}: {idle}")
        out.append(
            f"connections dropped by the server: {tally.dropped_connections}; stray payloads: {tally.strays}; "
            "server exit after SIGTERM: "
            + (f"{self.server_exit} in {self.exit_seconds:.1f} s" if self.server.process else "n/a (attached)")
        )
        if tally.problems:
            out += ["", "problems (how many of each, and the first):"]
            ranked = sorted(tally.problems.values(), key=lambda entry: -entry[0])
            out += [f"  {count:>5} x {example[:300]}" for count, example in ranked[:30]]
        failures = self.failures()
        out += ["", "result: " + ("FAIL: " + "; ".join(failures) if failures else "PASS")]
        return "\n".join(out)

    def ttft_line(self) -> str:
        idle, loaded = self.tally.ttft_idle, sorted(self.tally.ttft_loaded)
        text = f"time to first token: idle median {statistics.median(idle):.3f} s ({len(idle)} streams)"
        if loaded:
            p95 = loaded[min(len(loaded) - 1, math.ceil(0.95 * len(loaded)) - 1)]
            text += f"; loaded median {statistics.median(loaded):.3f} s, p95 {p95:.3f} s ({len(loaded)} streams)"
        return text

    def resource_lines(self) -> list[str]:
        if len(self.samples) < 2:
            return ["server rss/fds: not measured (no --pid)"]
        first, last = self.samples[0], self.samples[-1]
        half = self.samples[len(self.samples) // 2 :]

        def trend(value: Callable[[Sample], float], unit: str) -> str:
            whole = slope_per_minute([(s.at, value(s)) for s in self.samples])
            later = slope_per_minute([(s.at, value(s)) for s in half])
            text = f"trend {whole or 0:+.1f}{unit}/min"
            return text + (f" (second half {later:+.1f}{unit}/min)" if later is not None else "")

        return [
            f"server rss: {first.rss / MIB:.0f} MiB at start, {last.rss / MIB:.0f} MiB at end, "
            f"{trend(lambda s: s.rss / MIB, ' MiB')}, {len(self.samples)} samples",
            f"server open fds: {first.fds} at start, {last.fds} at end, {trend(lambda s: s.fds, '')}",
        ]


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of value over time, per minute."""
    if len(points) < 3:
        return None
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / spread
