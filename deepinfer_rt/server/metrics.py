"""/metrics: the scheduler's and the HTTP process's counters in Prometheus text format (prometheus_client)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

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


class _StatsCollector:
    def __init__(self, stats: dict):
        self.stats = stats

    def collect(self):
        for key, name, doc, is_counter in _METRICS:
            if key in self.stats:
                family = CounterMetricFamily(name, doc) if is_counter else GaugeMetricFamily(name, doc)
                family.add_metric([], float(self.stats[key]))
                yield family


def render(stats: dict) -> str:
    registry = CollectorRegistry()
    registry.register(_StatsCollector(stats))
    return generate_latest(registry).decode()
