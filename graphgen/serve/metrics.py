"""``/metrics``: Prometheus text format, one registry per server (tests run several in one process).

Histograms are observed as events happen (TTFT and inter-token latency by the engine loop; save
and commit latency from the engine's timings); gauges and totals are read from the engine's latest
:class:`EngineStats` snapshot at scrape time, so they can never drift from the engine's own counts.
The snapshot is taken when the engine loop starts, before the server accepts requests, so the gauges
are right from the first scrape. Where vLLM has a series of the same meaning it is also exported
under vLLM's name (labelled ``model_name``), so vLLM's dashboards read a graphgen server.
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
           ("graphgen_kv_blocks_free", "free_blocks", "Device KV blocks free (pinned blocks are not)."),
           ("graphgen_device_prefix_cached_blocks", "device_cached_blocks",
            "Device KV blocks the device prefix cache holds (pool.device_cache)."))
_TOTALS = (("graphgen_prefix_cache_hit_tokens", "prefix_hit_tokens", "Prompt tokens loaded from the KV pool."),
           ("graphgen_prompt_tokens", "prompt_tokens", "Prompt tokens prefilled."),
           ("graphgen_generation_tokens", "generation_tokens", "Tokens generated."),
           ("graphgen_pool_puts", "puts", "KV blocks committed to the pool."),
           ("graphgen_pool_put_failures", "put_failures", "KV blocks the pool refused or failed to store."),
           ("graphgen_kv_save_failures", "save_failures", "Saves that failed (nothing committed)."),
           ("graphgen_pool_errors", "pool_errors", "Pool lookups/loads that raised (recomputed)."),
           ("graphgen_engine_steps", "steps", "Engine steps (one generated graph each)."),
           ("graphgen_preemptions", "preemptions", "Requests preempted (blocks taken back, recomputed later)."),
           ("graphgen_mixed_steps", "mixed_steps", "Engine steps carrying decode rows and prompt chunks together."),
           ("graphgen_decode_rows_stalled", "decode_rows_stalled",
            "Per step, running requests that could decode but were not in it (summed): the decode stall."),
           ("graphgen_prefills", "prefills", "Prompt prefills begun (n / best_of copies forked from one not counted)."),
           ("graphgen_forked_requests", "forks", "Requests that shared another's prompt KV blocks (n / best_of)."),
           ("graphgen_device_prefix_hit_blocks", "device_hit_blocks",
            "Prompt blocks shared from the device prefix cache (not loaded from the pool)."))


# vLLM's names for the same quantities (labelled model_name, as vLLM's are)
_VLLM_GAUGES = (("vllm:num_requests_running", "running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "waiting", "Number of requests waiting to be processed."))
_VLLM_TOTALS = (("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
                ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
                ("vllm:num_preemptions", "preemptions", "Cumulative number of preemption from the engine."))
_TOKEN_BUCKETS = tuple(float(b) for b in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000))


class _StatsCollector:
    def __init__(self, model_name: str):
        self.snapshot = EngineStats()
        self.model_name = model_name
        self.num_blocks = 0  # device KV blocks in all: the free count at start-up (nothing in use yet)

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
        m = [self.model_name]
        for name, attr, doc in _VLLM_GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, getattr(s, attr))
            yield g
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              labels=["model_name"])
        g.add_metric(m, (1.0 - s.free_blocks / self.num_blocks) if self.num_blocks else 0.0)
        yield g
        for name, attr, doc in _VLLM_TOTALS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, getattr(s, attr))
            yield c
        if s.spec_decode_num_accepted_tokens_per_pos:  # speculative decoding: graphgen's and vLLM's names
            yield from self._spec_decode(s, "graphgen_", [], [])
            yield from self._spec_decode(s, "vllm:", ["model_name"], m)

    @staticmethod
    def _spec_decode(s: EngineStats, prefix: str, labels: list, values: list):
        for attr, doc in (("num_draft_tokens", "Draft tokens verified (speculative decoding)."),
                          ("num_accepted_tokens", "Draft tokens accepted (speculative decoding).")):
            c = CounterMetricFamily(f"{prefix}spec_decode_{attr}", doc, labels=labels)
            c.add_metric(values, getattr(s, f"spec_decode_{attr}"))
            yield c
        c = CounterMetricFamily(f"{prefix}spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by draft position (0: the first draft).",
                                labels=[*labels, "position"])
        for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            c.add_metric([*values, str(pos)], n)
        yield c


class _Both:
    """One observation, two series: graphgen's and vLLM's name (labelled ``model_name``)."""

    def __init__(self, *hists):
        self.hists = hists

    def observe(self, v: float) -> None:
        for h in self.hists:
            h.observe(v)


class ServerMetrics:
    def __init__(self, model_name: str = ""):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._stats = _StatsCollector(model_name)
        self.registry.register(self._stats)
        r = self.registry

        def vllm(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name=model_name)

        self.ttft = _Both(Histogram("graphgen_time_to_first_token_seconds", "Request arrival to its first token.",
                                    buckets=_LATENCY_BUCKETS, registry=r),
                          vllm("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."))
        itl = Histogram("graphgen_inter_token_latency_seconds", "Time between a request's tokens.",
                        buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = _Both(itl, vllm("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
                         vllm("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."))
        self.e2e = _Both(Histogram("graphgen_e2e_request_latency_seconds", "Request arrival to its last token.",
                                   buckets=_LATENCY_BUCKETS, registry=r),
                         vllm("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."))
        # per-request phases, measured by the engine loop at step granularity (docs/serve.md)
        self.queue = vllm("vllm:request_queue_time_seconds", "Time spent in the WAITING phase for the request.")
        self.prefill = vllm("vllm:request_prefill_time_seconds", "Time spent in the PREFILL phase for the request.")
        self.decode = vllm("vllm:request_decode_time_seconds", "Time spent in the DECODE phase for the request.")
        self.inference = vllm("vllm:request_inference_time_seconds",
                              "Time spent in the RUNNING phase for the request.")
        self.prompt_tokens = vllm("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                  _TOKEN_BUCKETS)
        self.generation_tokens = vllm("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                      _TOKEN_BUCKETS)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["finished_reason", "model_name"], registry=r)
        self.http = Counter("graphgen_http_requests", "HTTP responses by route, method and status code.",
                            ["route", "method", "status"], registry=r)
        self._http_vllm = Counter("http_requests_total", "Total number of requests by method, status and handler.",
                                  ["handler", "method", "status"], registry=r)
        self.forward = Histogram("graphgen_forward_latency_seconds", "One engine step's forward (generated graph).",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.save = Histogram("graphgen_kv_save_latency_seconds", "Forward start to the step's KV saved to staging.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.commit = Histogram("graphgen_kv_commit_latency_seconds", "KV saved to staging to every block in the pool.",
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.step_prefill_tokens = Histogram("graphgen_step_prefill_tokens",
                                             "Prompt tokens (whole prompts and chunks) of one step with prompt work.",
                                             buckets=_TOKEN_BUCKETS, registry=r)
        self.step_stalled = Histogram("graphgen_step_decode_rows_stalled",
                                      "Running requests left out of one step with prompt work (decode stall).",
                                      buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.requests = Counter("graphgen_requests", "Finished requests by finish reason.", ["finish_reason"],
                                registry=r)
        self.bad_requests = Counter("graphgen_bad_requests", "Requests refused with a 4xx.", registry=r)
        self._lock = threading.Lock()

    def finished(self, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self._success.labels(finished_reason=finish_reason, model_name=self.model_name).inc()

    def http_response(self, route: str, method: str, status: int) -> None:
        self.http.labels(route=route, method=method, status=str(status)).inc()
        self._http_vllm.labels(handler=route, method=method, status=f"{status // 100}xx").inc()

    def set_num_blocks(self, n: int) -> None:
        self._stats.num_blocks = n

    def update_stats(self, stats: EngineStats) -> None:
        self._stats.snapshot = stats  # one reference swap: a scrape sees one whole snapshot

    def observe_timing(self, name: str, value: float) -> None:
        """One sample from the engine's timings: seconds, or a per-step count (prefill tokens, stalls)."""
        {"forward": self.forward, "save": self.save, "commit": self.commit,
         "prefill_tokens": self.step_prefill_tokens, "decode_rows_stalled": self.step_stalled}[name].observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
