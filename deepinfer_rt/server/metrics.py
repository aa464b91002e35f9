"""/metrics in Prometheus text format (prometheus_client): latency histograms and token counters the HTTP process
measures as clients see them (time to first token, inter-token latency, end-to-end latency, prompt and generated
tokens), the scheduler's queue-time histogram, and the engine's gauges and counters (queue, KV pool, prefix-cache
hit rate, speculative acceptance)."""
from __future__ import annotations

import bisect

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0)
"""Upper bounds of the histograms' buckets, in seconds (+Inf is implied)."""

# (stats key, metric name, help, is_counter)
_METRICS = (
    ("num_waiting", "deepinfer_num_waiting_requests", "Sequences waiting in the scheduler queue", False),
    ("num_running", "deepinfer_num_running_requests", "Sequences in the running batch", False),
    ("num_inflight_seqs", "deepinfer_num_inflight_sequences", "Sequences admitted by the HTTP process", False),
    ("max_inflight_seqs", "deepinfer_max_inflight_sequences", "Queue limit (beyond it: 503)", False),
    ("gen_throughput", "deepinfer_gen_throughput_tokens_per_s", "Generated tokens/s over the last 10 s", False),
    ("num_generated_tokens", "deepinfer_generation_tokens", "Generated tokens", True),
    ("hit_rate", "deepinfer_cache_hit_rate", "Prefix-cache hit rate (hit tokens / query tokens)", False),
    ("num_pages", "deepinfer_kv_pool_pages", "KV pool pages", False),
    ("num_free_pages", "deepinfer_kv_pool_free_pages", "KV pool pages free", False),
    ("num_cached_pages", "deepinfer_kv_cached_pages", "KV pages held by the prefix cache", False),
    ("num_retractions", "deepinfer_retractions", "Requests retracted to free KV", True),
    ("num_rejected_overload", "deepinfer_rejected_overload", "Requests refused at the queue limit", True),
    ("num_engine_restarts", "deepinfer_engine_restarts", "Times the engine process died and was restarted", True),
)
_SPEC_METRICS = (
    ("drafted", "deepinfer_spec_draft_tokens", "Speculative draft tokens verified", True),
    ("accepted", "deepinfer_spec_accepted_tokens", "Speculative draft tokens accepted", True),
    ("acceptance_rate", "deepinfer_spec_acceptance_rate", "Accepted / drafted tokens", False),
    ("mean_accepted_length", "deepinfer_spec_mean_accepted_length", "Accepted drafts per verification step",
     False),
)


class LatencyHistogram:
    """Plain-data histogram (counts per LATENCY_BUCKETS_S bucket, sum): the scheduler process keeps one and sends
    it with its stats."""

    def __init__(self):
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.sum = 0.0

    def observe(self, value_s: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, value_s)] += 1
        self.sum += value_s

    def as_dict(self) -> dict:
        return {"counts": list(self.counts), "sum": self.sum}


def _histogram_family(name: str, doc: str, data: dict) -> HistogramMetricFamily:
    buckets, total = [], 0
    for bound, count in zip((*map(str, LATENCY_BUCKETS_S), "+Inf"), data["counts"]):
        total += count
        buckets.append((bound, total))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=data["sum"])


class _StatsCollector:
    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        for source, table in ((self.stats, _METRICS), (self.stats.get("spec") or {}, _SPEC_METRICS)):
            for key, name, doc, is_counter in table:
                if key in source:
                    family = CounterMetricFamily(name, doc) if is_counter else GaugeMetricFamily(name, doc)
                    family.add_metric([], float(source[key]))
                    yield family
        if "queue_time" in self.stats:
            yield _histogram_family("deepinfer_queue_time_seconds",
                                    "From admission by the scheduler to the request's first scheduled step",
                                    self.stats["queue_time"])


class ServerMetrics:
    """The HTTP process's measurements, per sequence as its client sees it (generated tokens are counted by the
    scheduler: deepinfer_generation_tokens)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        kw = dict(registry=self.registry, buckets=LATENCY_BUCKETS_S)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "From submission to the first token", **kw)
        self.itl = Histogram("deepinfer_inter_token_latency_seconds", "Time per output token after the first",
                             **kw)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "From submission to the last token", **kw)
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.cached_tokens = Counter("deepinfer_prompt_cached_tokens", "Prompt tokens served by the prefix cache",
                                     registry=self.registry)

    def render(self, stats: dict) -> str:
        registry = CollectorRegistry()
        registry.register(_StatsCollector(stats))
        return generate_latest(self.registry).decode() + generate_latest(registry).decode()


def render(stats: dict) -> str:
    """The engine's statistics alone (no HTTP-side measurements)."""
    return ServerMetrics().render(stats)
