"""``/metrics``: Prometheus text format, one registry per server (tests run several in one process).

Histograms are observed as events happen (TTFT and inter-token latency by the engine loop; save
and commit latency from the engine's timings); gauges and totals are read from the engine's latest
:class:`EngineStats` snapshot at scrape time, so they can never drift from the engine's own counts.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .engine_api import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# (metric name, EngineStats field, help) — gauges, then totals
_GAUGES = (("graphgen_num_requests_running", "running", "Requests being generated."),
           ("graphgen_num_requests_waiting", "waiting", "Requests queued for their prefill."),
           ("graphgen_kv_saves_pending", "saves_pending", "Host commits of saved KV still in flight."),
           ("graphgen_kv_blocks_free", "free_blocks", "Device KV blocks free (pinned blocks are not)."))
_TOTALS = (("graphgen_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens loaded from the KV pool."),
           ("graphgen_prompt_tokens", "prompt_tokens", "Prompt tokens prefilled."),
           ("graphgen_generation_tokens", "generation_tokens", "Tokens generated."),
           ("graphgen_pool_puts", "puts", "KV blocks committed to the pool."),
           ("graphgen_pool_put_failures", "put_failures", "KV blocks the pool refused or failed to store."),
           ("graphgen_kv_save_failures", "save_failures", "Saves that failed (nothing committed)."),
           ("graphgen_pool_errors", "pool_errors", "Pool lookups/loads that raised (recomputed)."),
           ("graphgen_engine_steps", "steps", "Engine steps (one generated graph each)."),
           ("graphgen_preemptions", "preemptions", "Requests preempted (blocks taken back, recomputed later)."))


class _StatsCollector:
    def __init__(self):
        self.snapshot = EngineStats()

    def collect(self):
        s = self.snapshot
        for name, attr, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], getattr(s, attr))
            yield g
        for name, attr, doc in _TOTALS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], getattr(s, attr))
            yield c


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._stats = _StatsCollector()
        self.registry.register(self._stats)
        r = self.registry
        self.ttft = Histogram("graphgen_time_to_first_token_seconds", "Request arrival to its first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("graphgen_inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("graphgen_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.forward = Histogram("graphgen_forward_latency_seconds", "One engine step's forward (generated graph).",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.save = Histogram("graphgen_kv_save_latency_seconds", "Forward start to the step's KV saved to staging.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.commit = Histogram("graphgen_kv_commit_latency_seconds", "KV saved to staging to every block in the pool.",
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("graphgen_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=r)
        self.bad_requests = Counter("graphgen_bad_requests", "Requests refused with a 4xx.", registry=r)
        self._lock = threading.Lock()

    def update_stats(self, stats: EngineStats) -> None:
        self._stats.snapshot = stats  # one reference swap: a scrape sees one whole snapshot

    def observe_timing(self, name: str, seconds: float) -> None:
        {"forward": self.forward, "save": self.save, "commit": self.commit}[name].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
