"""Salience's own Prometheus metrics, every one of them defined here.

They live in prometheus_client's default registry, where vLLM's PrometheusStatLogger
puts its engine metrics (`vllm:*`), so one scrape of `GET /metrics` returns both.
Frontends pass their name (`lmtp_ws`, `lmtp_tcp`, `grpc`) as the `frontend` label;
nothing here knows a socket. Session gauges are read from the live SessionStores at
scrape time rather than kept in step with every append. docs/metrics.md lists them all.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from salience.core.sessions import SessionStore

__all__ = [
    "AUTH_FAILURES",
    "CONNECTIONS_ACTIVE",
    "CONNECTIONS_DROPPED",
    "CONTENT_TYPE",
    "ERRORS",
    "FRONTENDS",
    "READOUT_BYTES",
    "READOUT_POSITIONS",
    "SESSIONS_CREATED",
    "SESSIONS_EVICTED",
    "STREAMS_ACTIVE",
    "STREAMS_ENDED",
    "STREAMS_STARTED",
    "StreamRecord",
    "exposition",
    "watch_sessions",
]

FRONTENDS = ("lmtp_ws", "lmtp_tcp", "grpc")
_LMTP_KINDS = ("generate", "score", "session_generate")
_KINDS = {"lmtp_ws": _LMTP_KINDS, "lmtp_tcp": _LMTP_KINDS, "grpc": ("session_generate",)}

STREAMS_STARTED = Counter(
    "salience_streams_started",
    "Streams admitted (GENERATE, SCORE, SESSION_GENERATE, gRPC Generate)",
    ["frontend", "kind"],
)
STREAMS_ACTIVE = Gauge("salience_streams_active", "Streams running now", ["frontend", "kind"])
STREAMS_ENDED = Counter(
    "salience_streams_ended",
    "Streams ended, by finish reason: stop, length, cancelled, or error",
    ["frontend", "kind", "finish_reason"],
)
ERRORS = Counter(
    "salience_errors",
    "Errors sent to clients, by kind: the SalienceError class (InvalidArgument, Unavailable, ...), "
    "LmtpError for a line the LMTP codec refused, SlowClient, InternalError",
    ["frontend", "kind"],
)
SESSIONS_CREATED = Counter("salience_sessions_created", "Sessions opened or forked")
SESSIONS_EVICTED = Counter(
    "salience_sessions_evicted", "Sessions evicted: ttl (idle too long) or lru (limits reached)", ["reason"]
)
READOUT_POSITIONS = Counter("salience_readout_positions", "Positions sent with a concept readout", ["frontend"])
READOUT_BYTES = Counter(
    "salience_readout_bytes",
    "Bytes of readout values sent (LMTP: the JSON text of each readout list; gRPC: 4 per float)",
    ["frontend"],
)
AUTH_FAILURES = Counter("salience_auth_failures", "Requests refused for a missing or wrong bearer token", ["frontend"])
CONNECTIONS_ACTIVE = Gauge("salience_connections_active", "LMTP connections open now", ["frontend"])
CONNECTIONS_DROPPED = Counter(
    "salience_connections_dropped",
    "LMTP connections that ended with work lost or refused: client_gone (closed with streams running), "
    "slow_client, send_timeout, oversized_frame, server_shutdown",
    ["frontend", "cause"],
)

# Series that exist from the start, so dashboards and rate() see zeros rather than gaps.
for _frontend, _kinds in _KINDS.items():
    AUTH_FAILURES.labels(_frontend)
    READOUT_POSITIONS.labels(_frontend)
    READOUT_BYTES.labels(_frontend)
    for _kind in _kinds:
        STREAMS_STARTED.labels(_frontend, _kind)
        STREAMS_ACTIVE.labels(_frontend, _kind)
for _reason in ("ttl", "lru"):
    SESSIONS_EVICTED.labels(_reason)


class StreamRecord:
    """One admitted stream: started and active now; `end` once with its finish reason."""

    __slots__ = ("_active", "ended", "frontend", "kind")

    def __init__(self, frontend: str, kind: str) -> None:
        self.frontend = frontend
        self.kind = kind
        self.ended = False
        STREAMS_STARTED.labels(frontend, kind).inc()
        self._active = STREAMS_ACTIVE.labels(frontend, kind)
        self._active.inc()

    def end(self, finish_reason: str) -> None:
        """Count the stream as ended (`stop`, `length`, `cancelled` or `error`); later calls do nothing."""
        if not self.ended:
            self.ended = True
            self._active.dec()
            STREAMS_ENDED.labels(self.frontend, self.kind, finish_reason).inc()


class _SessionGauges(Collector):
    """Open sessions and their stored tokens, summed over the live stores when scraped."""

    def __init__(self) -> None:
        self.stores: weakref.WeakSet[SessionStore] = weakref.WeakSet()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stores = list(self.stores)
        yield GaugeMetricFamily("salience_sessions_open", "Sessions held now", sum(len(s) for s in stores))
        yield GaugeMetricFamily(
            "salience_session_tokens_stored",
            "Tokens held across all sessions (4 bytes each)",
            sum(s.stored_tokens() for s in stores),
        )

    def describe(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily("salience_sessions_open", "Sessions held now")
        yield GaugeMetricFamily("salience_session_tokens_stored", "Tokens held across all sessions")


_SESSION_GAUGES = _SessionGauges()
REGISTRY.register(_SESSION_GAUGES)


def watch_sessions(store: SessionStore) -> None:
    """Include `store` in the session gauges for as long as it lives."""
    _SESSION_GAUGES.stores.add(store)


CONTENT_TYPE = CONTENT_TYPE_LATEST


def exposition() -> bytes:
    """Every metric of the process, vLLM's included, in Prometheus text format."""
    return generate_latest(REGISTRY)
