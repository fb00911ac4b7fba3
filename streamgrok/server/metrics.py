"""Prometheus metrics on a registry owned by one server (no module-global state).

Names follow the Prometheus conventions: units in the name (`_seconds`, `_tokens`), counters
end in `_total` and only grow, gauges never end in `_total`; no `_created` series."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from streamgrok import __version__
from streamgrok.engine.snapshot import EngineSnapshot

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 2, 5, 10, 20, 30, 60, 120)


class ServerMetrics:
    """TTFT/TBT histograms, token/error/drop counters, session and KV gauges, build info."""

    def __init__(self, drops: Callable[[], dict[str, int]] = dict,
                 snapshot: Callable[[], EngineSnapshot | None] = lambda: None,
                 model: Callable[[], str] = lambda: "",
                 resumption: Callable[[], dict[str, int]] = dict,
                 speech: Callable[[], dict[str, dict]] = dict,
                 session_cost: Callable[[], dict[str, float | None]] = dict) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        r = self.registry
        labels = ["model"]
        self.ttft = Histogram("streamgrok_ttft_seconds", "Time to first token", labels,
                              registry=r, buckets=LATENCY_BUCKETS)
        self.tbt = Histogram("streamgrok_tbt_seconds", "Time between tokens", labels,
                             registry=r, buckets=LATENCY_BUCKETS)
        self.tokens = Counter("streamgrok_generated_tokens", "Tokens generated", labels,
                              registry=r)
        self.answers = Counter("streamgrok_answers", "Answers finished, by finish reason",
                               ["model", "reason"], registry=r)
        self.errors = Counter("streamgrok_errors", "Error events sent, by code", ["code"],
                              registry=r)
        self.refused = Counter("streamgrok_sessions_refused", "Sessions refused busy, by the "
                               "rule that refused them", ["reason"], registry=r)
        self.refused_questions = Counter("streamgrok_questions_refused",
                                         "HTTP requests refused busy (the engine was behind), "
                                         "by the rule that refused them", ["reason"],
                                         registry=r)
        self.shortened_answers = Counter("streamgrok_answers_shortened",
                                         "Live sessions' answers shortened under load (the "
                                         "engine was behind), by rule", ["reason"], registry=r)
        self.outbound_dropped = Counter("streamgrok_outbound_dropped",
                                        "Messages dropped for slow clients", registry=r)
        self.degraded = Gauge("streamgrok_live_fps_scale", "Live sampling rate over the "
                              "requested one (1 = not degraded)", registry=r)
        self.sessions = Gauge("streamgrok_active_sessions", "Live client sessions", registry=r)
        self.build = Info("streamgrok_build", "streamgrok version", registry=r)
        self.build.info({"version": __version__})
        r.register(_DropsCollector(drops))
        r.register(_ResumptionCollector(resumption))
        r.register(_EngineCollector(snapshot, model))
        r.register(_SpeechCollector(speech, session_cost))

    def observe_answer(self, metrics: dict) -> None:
        model = self.model()
        if metrics.get("ttft_ms") is not None:
            self.ttft.labels(model).observe(metrics["ttft_ms"] / 1e3)
        for gap_ms in metrics.get("tbt_ms", []):
            self.tbt.labels(model).observe(gap_ms / 1e3)
        self.tokens.labels(model).inc(metrics.get("tokens") or 0)
        self.answers.labels(model, metrics.get("finish_reason") or "unknown").inc()

    def render(self) -> bytes:
        """The Prometheus text exposition, without `_created` series."""
        text = generate_latest(self.registry)
        return b"".join(line for line in text.splitlines(keepends=True)
                        if b"_created" not in line.split(b" ", 1)[0])


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


class _ResumptionCollector(Collector):
    """Detached sessions waiting for their clients, and what became of resume requests."""

    def __init__(self, resumption: Callable[[], dict[str, int]]) -> None:
        self.resumption = resumption

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        numbers = self.resumption()
        if not numbers:
            return
        yield GaugeMetricFamily("streamgrok_detached_sessions", "Sessions whose client left, "
                                "kept for a resume", value=numbers["detached"])
        outcomes = CounterMetricFamily("streamgrok_detached_sessions_ended",
                                       "Detached sessions that ended, by outcome (resumed, "
                                       "expired, evicted)", labels=["outcome"])
        for outcome in ("resumed", "expired", "evicted"):
            outcomes.add_metric([outcome], numbers[outcome])
        yield outcomes
        yield CounterMetricFamily("streamgrok_resumes_refused", "session.resume requests "
                                  "refused (unknown, expired, other key, in use, no room)",
                                  value=numbers["refused"])


class _SpeechCollector(Collector):
    """The shared speech recognisers' work, by recogniser, and what the load governor has
    learned one session costs (the share of the CPU its media workers take at the full rate,
    the share of the time its speech keeps the recogniser busy)."""

    def __init__(self, speech: Callable[[], dict[str, dict]],
                 session_cost: Callable[[], dict[str, float | None]]) -> None:
        self.speech = speech
        self.session_cost = session_cost

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        recognisers = self.speech()
        label = ["recogniser"]
        families = {
            "segments": CounterMetricFamily("streamgrok_speech_segments", "Speech segments "
                                            "recognised", labels=label),
            "calls": CounterMetricFamily("streamgrok_speech_calls", "Recogniser calls",
                                         labels=label),
            "audio_s": CounterMetricFamily("streamgrok_speech_audio_seconds", "Seconds of "
                                           "speech recognised", labels=label),
            "busy_s": CounterMetricFamily("streamgrok_speech_busy_seconds", "Seconds the "
                                          "recogniser worked", labels=label),
            "dropped": CounterMetricFamily("streamgrok_speech_dropped", "Speech segments "
                                           "left unrecognised (its queue was full)",
                                           labels=label),
        }
        wait = GaugeMetricFamily("streamgrok_speech_queue_wait_p95_seconds", "How long recent "
                                 "segments waited for the recogniser (p95)", labels=label)
        for name, stats in sorted(recognisers.items()):
            for key, family in families.items():
                family.add_metric([name], stats[key])
            if stats.get("wait_p95_s") is not None:
                wait.add_metric([name], stats["wait_p95_s"])
        yield from families.values()
        yield wait
        cost = GaugeMetricFamily("streamgrok_session_cost_ratio", "What one more live session "
                                 "is measured to add: media (its media workers' share of the "
                                 "cores at the full rate), speech (the recogniser's busy "
                                 "share) and engine (the engine's share of the cores)",
                                 labels=["part"])
        for part, value in sorted(self.session_cost().items()):
            if value is not None:
                cost.add_metric([part], value)
        yield cost


class _EngineCollector(Collector):
    """The engine's numbers, read from its published snapshot when scraped."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None],
                 model: Callable[[], str]) -> None:
        self.snapshot = snapshot
        self.model = model

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        snap = self.snapshot()
        model = self.model()
        info = GaugeMetricFamily("streamgrok_model_info", "The served model (value 1)",
                                 labels=["model"])
        info.add_metric([model], 1 if snap is not None else 0)
        yield info
        if snap is None:  # the model is loading
            return
        used, total = snap.kv_pages_used, snap.kv_pages_total
        yield GaugeMetricFamily("streamgrok_kv_pages_in_use", "KV pages in use", value=used)
        yield GaugeMetricFamily("streamgrok_kv_pages_capacity", "KV pages in the pool",
                                value=total)
        yield GaugeMetricFamily("streamgrok_kv_usage_ratio", "KV pages in use over the pool",
                                value=used / total if total else 0.0)
        yield GaugeMetricFamily("streamgrok_kv_used_bytes", "KV bytes in use",
                                value=snap.kv_bytes_used)
        yield GaugeMetricFamily("streamgrok_kv_parked_bytes", "KV bytes of detached sessions "
                                "parked in host memory", value=snap.parked_bytes)
        yield CounterMetricFamily("streamgrok_evicted_tokens", "Tokens evicted from the KV cache",
                                  value=snap.evicted_tokens)
        yield from _tier_metrics(snap.host_tier)
        yield from _vision_metrics(snap.vision)
        yield CounterMetricFamily("streamgrok_prefill_tokens", "Tokens prefilled",
                                  value=snap.prefill_tokens)
        yield CounterMetricFamily("streamgrok_decode_tokens", "Tokens decoded",
                                  value=snap.decode_tokens)
        yield CounterMetricFamily("streamgrok_engine_steps", "Engine steps", value=snap.steps)
        dropped = CounterMetricFamily("streamgrok_engine_dropped",
                                      "Items the engine dropped from session queues, by reason",
                                      labels=["reason"])
        for reason, count in sorted(snap.dropped.items()):
            dropped.add_metric([reason], count)
        yield dropped
        yield GaugeMetricFamily("streamgrok_engine_sessions", "Engine sessions (live and "
                                "one-shot HTTP requests)", value=snap.sessions)


def _vision_metrics(vision: dict | None) -> Iterator[CounterMetricFamily]:
    """The vision tower's frame batcher (nothing for a text model)."""
    if vision is None:
        return
    yield CounterMetricFamily("streamgrok_vision_frames", "Frames through the vision tower",
                              value=vision["frames"])
    yield CounterMetricFamily("streamgrok_vision_batches", "Vision tower forward passes",
                              value=vision["batches"])
    yield CounterMetricFamily("streamgrok_vision_errors", "Frames the vision tower failed on "
                              "(dropped, with an error to their session)",
                              value=vision["errors"])
    yield CounterMetricFamily("streamgrok_vision_waits", "Frames that waited for room in the "
                              "vision queue (full: the submitter waits, nothing is dropped)",
                              value=vision["waited"])


def _tier_metrics(tier: dict | None) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """The host KV tier and recall (nothing when the server runs without a host tier)."""
    if tier is None:
        return
    yield GaugeMetricFamily("streamgrok_kv_host_bytes", "Bytes of evicted KV in the host tier",
                            value=tier["bytes_used"])
    yield GaugeMetricFamily("streamgrok_kv_host_capacity_bytes", "The host tier's budget",
                            value=tier["bytes_capacity"])
    yield GaugeMetricFamily("streamgrok_kv_disk_bytes", "Bytes of evicted KV in the disk tier",
                            value=tier["disk_bytes_used"])
    yield CounterMetricFamily("streamgrok_kv_host_dropped_tokens",
                              "Tokens that left the host tier for good (its budget)",
                              value=tier["dropped_tokens"])
    yield CounterMetricFamily("streamgrok_kv_recalls", "Answers that recalled from the host tier",
                              value=tier["recalls"])
    yield CounterMetricFamily("streamgrok_kv_recalled_tokens",
                              "Tokens recalled into answers (summed over layers)",
                              value=tier["recalled_tokens"])
    yield CounterMetricFamily("streamgrok_kv_guard_recalls",
                              "Recalls the hit-rate guard extended", value=tier["guard_recalls"])
    yield CounterMetricFamily("streamgrok_kv_stream_recalls",
                              "Streamed chunks that recalled from the host tier",
                              value=tier["stream_recalls"])
    yield CounterMetricFamily("streamgrok_kv_restored_tokens",
                              "Tokens streamed chunks moved back from the host tier into "
                              "their session's working set (summed over layers)",
                              value=tier["restored_tokens"])
    rate = tier["kv_hit_rate_mean"]
    yield GaugeMetricFamily("streamgrok_kv_hit_rate",
                            "Estimated KV hit rate, mean of recent answers (NaN before any)",
                            value=float("nan") if rate is None else rate)
