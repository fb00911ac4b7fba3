"""Prometheus metrics on a registry owned by one server (no module-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5, 10)


class ServerMetrics:
    """TTFT/TBT histograms, token/error/drop counters, session and KV gauges."""

    def __init__(self, drops: Callable[[], dict[str, int]] = dict) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("streamgrok_ttft_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tbt = Histogram("streamgrok_tbt_seconds", "Time between tokens", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.tokens = Counter("streamgrok_generated_tokens", "Tokens generated", registry=r)
        self.answers = Counter("streamgrok_answers", "Answers finished", ["reason"], registry=r)
        self.errors = Counter("streamgrok_errors", "Error events sent", ["code"], registry=r)
        r.register(_DropsCollector(drops))
        self.degraded = Gauge("streamgrok_live_fps_scale", "Live sampling rate over the "
                              "requested one (1 = not degraded)", registry=r)
        self.refused = Counter("streamgrok_sessions_refused", "Sessions refused busy",
                               registry=r)
        self.refused_questions = Counter("streamgrok_questions_refused",
                                         "Questions refused busy (the engine was behind)",
                                         registry=r)
        self.outbound_dropped = Counter("streamgrok_outbound_dropped",
                                        "Messages dropped for slow clients", registry=r)
        self.sessions = Gauge("streamgrok_active_sessions", "Client sessions", registry=r)
        self.kv_pages = Gauge("streamgrok_kv_pages_in_use", "KV pages in use", registry=r)
        self.kv_pages_total = Gauge("streamgrok_kv_pages_total", "KV pages in the pool",
                                    registry=r)
        self.evicted = Gauge("streamgrok_evicted_tokens", "Tokens evicted so far", registry=r)

    def observe_answer(self, metrics: dict) -> None:
        if metrics.get("ttft_ms") is not None:
            self.ttft.observe(metrics["ttft_ms"] / 1e3)
        for gap_ms in metrics.get("tbt_ms", []):
            self.tbt.observe(gap_ms / 1e3)
        self.tokens.inc(metrics.get("tokens") or 0)
        self.answers.labels(metrics.get("finish_reason") or "unknown").inc()

    def render(self, snapshot: dict | None) -> bytes:
        """Prometheus text exposition, with gauges refreshed from the engine snapshot (None
        while the model loads)."""
        if snapshot is not None:
            self.kv_pages.set(snapshot["kv_pages_used"])
            self.kv_pages_total.set(snapshot["kv_pages_total"])
            self.evicted.set(snapshot["evicted_tokens"])
        return generate_latest(self.registry)


class _DropsCollector(Collector):
    """`streamgrok_dropped_total{reason}`: everything every session dropped, by reason (the
    same counts the `stats` message shows, summed over live and finished sessions)."""

    def __init__(self, drops: Callable[[], dict[str, int]]) -> None:
        self.drops = drops

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("streamgrok_dropped", "Items dropped, by reason",
                                     labels=["reason"])
        for reason, count in sorted(self.drops().items()):
            family.add_metric([reason], count)
        yield family
