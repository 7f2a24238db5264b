"""Salience's own Prometheus metrics, every one of them defined here.

They live in prometheus_client's default registry, where vLLM's PrometheusStatLogger
puts its engine metrics (`vllm:*`), so one scrape of `GET /metrics` returns both.
Frontends pass their name (`lmtp_ws`, `lmtp_tcp`, `grpc`, `openai`) as the `frontend` label;
nothing here knows a socket. Session gauges are read from the live SessionStores at
scrape time rather than kept in step with every append. Core reports streams and sessions
through the observer interface of core/serving/observers.py, which this module subscribes
to on import; core never imports it. docs/metrics.md lists them all.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from salience.core.serving.observers import OBSERVERS, ResidualCounts, ServingObserver, SessionCounts

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
    "exposition",
]

FRONTENDS = ("lmtp_ws", "lmtp_tcp", "grpc", "openai")
_LMTP_KINDS = ("generate", "score", "session_generate")
_KINDS = {
    "lmtp_ws": _LMTP_KINDS,
    "lmtp_tcp": _LMTP_KINDS,
    "grpc": ("session_generate",),
    "openai": ("completion", "chat_completion", "response"),  # one stream per HTTP request, whatever its n
}

STREAMS_STARTED = Counter(
    "salience_streams_started",
    "Streams admitted (GENERATE, SCORE, SESSION_GENERATE, gRPC Generate)",
    ["frontend", "kind"],
)
# Client names come from the tokens file (and anonymous, token, admin): as many labels as the operator wrote.
CLIENT_STREAMS = Counter("salience_client_streams", "Streams admitted, per client", ["client"])
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


class _Reporter(ServingObserver):
    """The serving layer's events (core/serving/observers.py) as the metrics above."""

    def stream_admitted(self, frontend: str, kind: str, client: str | None) -> None:
        STREAMS_STARTED.labels(frontend, kind).inc()
        if client is not None:
            CLIENT_STREAMS.labels(client).inc()
        STREAMS_ACTIVE.labels(frontend, kind).inc()

    def stream_ended(self, frontend: str, kind: str, finish_reason: str) -> None:
        STREAMS_ACTIVE.labels(frontend, kind).dec()
        STREAMS_ENDED.labels(frontend, kind, finish_reason).inc()

    def store_opened(self, store: SessionCounts) -> None:
        _SESSION_GAUGES.stores.add(store)

    def budget_opened(self, budget: ResidualCounts) -> None:
        _RESIDUAL_GAUGES.budgets.add(budget)

    def sessions_created(self) -> None:
        SESSIONS_CREATED.inc()

    def sessions_evicted(self, reason: str, count: int) -> None:
        SESSIONS_EVICTED.labels(reason).inc(count)


class _SessionGauges(Collector):
    """Open sessions and their stored tokens, summed over the live stores when scraped."""

    def __init__(self) -> None:
        self.stores: weakref.WeakSet[SessionCounts] = weakref.WeakSet()

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


class _ResidualGauges(Collector):
    """The residual-row budget of each serving engine, read when scraped."""

    def __init__(self) -> None:
        self.budgets: weakref.WeakSet[ResidualCounts] = weakref.WeakSet()

    def collect(self) -> Iterable[GaugeMetricFamily]:
        budgets = list(self.budgets)
        for name, text, value in _RESIDUAL_METRICS:
            yield GaugeMetricFamily(name, text, sum(value(b) for b in budgets))

    def describe(self) -> Iterable[GaugeMetricFamily]:
        for name, text, _ in _RESIDUAL_METRICS:
            yield GaugeMetricFamily(name, text)


_RESIDUAL_METRICS = (
    (
        "salience_residual_rows_budget",
        "Residual rows all requests may hold at once (--residual-memory)",
        lambda b: b.rows,
    ),
    ("salience_residual_rows_held", "Residual rows reserved by running requests", lambda b: b.held),
    ("salience_residual_requests_waiting", "Requests queued for residual rows", lambda b: b.waiting),
)
_SESSION_GAUGES = _SessionGauges()
REGISTRY.register(_SESSION_GAUGES)
_RESIDUAL_GAUGES = _ResidualGauges()
REGISTRY.register(_RESIDUAL_GAUGES)

OBSERVERS.subscribe(_Reporter())


CONTENT_TYPE = CONTENT_TYPE_LATEST


def exposition() -> bytes:
    """Every metric of the process, vLLM's included, in Prometheus text format."""
    return generate_latest(REGISTRY)
