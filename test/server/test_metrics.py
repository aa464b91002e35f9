"""/metrics: latency histograms (TTFT, inter-token, end-to-end, queue time) and token counters move by what a request
did; engine gauges (prefix-cache hit rate) and speculative acceptance are exported; the request log."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from conftest import MODEL_NAME
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import wait_idle

from deepinfer_rt import SamplingParams
from deepinfer_rt.server.io_struct import ReadyMessage, SeqDelta
from deepinfer_rt.server.metrics import LatencyHistogram, render
from deepinfer_rt.server.tokenizer_manager import TokenizerManager


def _scrape(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples
            if not s.labels or s.labels.get("le") in (None, "+Inf")}


def test_a_request_moves_the_histograms_and_counters(server_url, client):
    wait_idle(server_url)
    before = _scrape(server_url)
    out = client.completions.create(model=MODEL_NAME, prompt="Count: one, two,", max_tokens=5, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    wait_idle(server_url)
    after = _scrape(server_url)

    def moved(name):
        return after[name] - before.get(name, 0.0)

    assert moved("deepinfer_time_to_first_token_seconds_count") == 2
    assert moved("deepinfer_e2e_request_latency_seconds_count") == 2
    assert moved("deepinfer_inter_token_latency_seconds_count") == out.usage.completion_tokens - 2
    assert moved("deepinfer_queue_time_seconds_count") == 1  # one engine request (n=2 shares it)
    assert moved("deepinfer_prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("deepinfer_generation_tokens_total") == out.usage.completion_tokens
    assert moved("deepinfer_e2e_request_latency_seconds_sum") >= moved("deepinfer_time_to_first_token_seconds_sum")
    assert 0.0 <= after["deepinfer_cache_hit_rate"] <= 1.0


def test_speculative_and_queue_time_from_engine_stats():
    queue = LatencyHistogram()
    for v in (0.003, 0.003, 2.0):
        queue.observe(v)
    text = render({"num_waiting": 0, "spec": {"drafted": 10, "accepted": 7, "acceptance_rate": 0.7,
                                               "mean_accepted_length": 1.4}, "queue_time": queue.as_dict()})
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("deepinfer_spec_accepted_tokens_total", None)] == 7
    assert samples[("deepinfer_spec_acceptance_rate", None)] == 0.7
    assert samples[("deepinfer_queue_time_seconds_bucket", "0.005")] == 2
    assert samples[("deepinfer_queue_time_seconds_bucket", "+Inf")] == 3
    assert samples[("deepinfer_queue_time_seconds_sum", None)] == pytest.approx(2.006)


def test_log_requests(smollm2_path, tmp_path, caplog):
    async def run():
        tm = TokenizerManager(str(smollm2_path), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", max_queued_seqs=4,
                              log_requests=True)
        tm.info = ReadyMessage(str(smollm2_path), max_position=64, vocab_size=100, eos_ids=(0,), max_num_seqs=4,
                               enable_prefix_cache=True)
        tm.max_inflight_seqs, tm.is_ready, tm.last_heartbeat = 8, True, float("inf")
        tm.send = lambda msg: None
        try:
            stream = tm.submit([[1, 2, 3]], SamplingParams(max_new_tokens=2))
            (rid,) = stream.open_rids
            stream.put(SeqDelta(rid, 0, [5], "a", prompt_tokens=3, completion_tokens=1))
            stream.put(SeqDelta(rid, 0, [6], "b", finish_reason="length", prompt_tokens=3, completion_tokens=2))
            return rid, [d async for d in stream]
        finally:
            tm.shutdown()

    with caplog.at_level(logging.INFO, logger="deepinfer_rt.server.tokenizer_manager"):
        rid, deltas = asyncio.run(run())
    assert len(deltas) == 2
    (line,) = [r.getMessage() for r in caplog.records if "request" in r.getMessage()]
    assert rid.rsplit("-", 1)[0] in line and "3 prompt tokens" in line and "2 completion tokens" in line
    assert "finish length" in line
