"""Expert parallelism on CPU (gloo): EP=2 worker pools against the single-process engine on tiny DeepSeek-V3.

Two pools per module (a process start costs seconds): plain EP=2, and EP=2 with EPLB rearranging every two
steps on a KV pool small enough to force retractions. Each pool ends with a failure test that breaks it.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.scheduler.batch import ScheduledBatch

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "def f(x):\n    return",
           "A long time ago in a galaxy far, far away, there was a small robot.", "?", "ok ok ok ok",
           "The quick brown fox jumps over the lazy dog"]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3,
                        prompt_logprobs=True)
SAMPLED = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, n=3, seed=11, ignore_eos=True)
CONSTRAINED = [SamplingParams(max_new_tokens=10, temperature=0, regex=r"[a-z]{3,8} [0-9]+"), GREEDY]


def _engine(path, **kwargs) -> Engine:
    return Engine(str(path), dtype="float32", page_size=4, **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    with _engine(tiny_v3_path, kv_cache_tokens=4096) as engine:
        yield {"greedy": engine.generate(PROMPTS, sampling_params=GREEDY),
               "sampled": engine.generate(PROMPTS[:3], sampling_params=SAMPLED),
               "constrained": engine.generate(PROMPTS[:2], sampling_params=CONSTRAINED)}


@pytest.fixture(scope="module")
def ep2(tiny_v3_path):
    with _engine(tiny_v3_path, kv_cache_tokens=4096, ep_size=2) as engine:
        yield engine


@pytest.fixture(scope="module")
def ep2_eplb(tiny_v3_path):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in [("DEEPINFER_EPLB", "1"), ("DEEPINFER_EPLB_INTERVAL", "2"), ("DEEPINFER_EPLB_WINDOW", "4"),
                            ("DEEPINFER_EPLB_REDUNDANT", "1")]:
            mp.setenv(name, value)
        with _engine(tiny_v3_path, kv_cache_tokens=48, chunked_prefill_tokens=7, ep_size=2) as engine:
            yield engine


def _max_diff(a: list, b: list) -> float:
    return max((abs(x - y) for x, y in zip(a, b) if x is not None), default=0.0)


def test_ep2_greedy_tokens_and_logprobs_match_ep1(ep2, reference):
    outs = ep2.generate(PROMPTS, sampling_params=GREEDY)
    ref = reference["greedy"]
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o, r in zip(outs, ref):
        assert _max_diff(o.logprobs, r.logprobs) < 1e-5
        assert _max_diff(o.prompt_logprobs, r.prompt_logprobs) < 1e-5
        ours, theirs = [p for row in o.top_logprobs for p in row], [p for row in r.top_logprobs for p in row]
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert _max_diff([v for _, v in ours], [v for _, v in theirs]) < 1e-5
    stats = ep2.stats
    assert stats["ep_size"] == 2 and min(stats["ep_tokens_per_rank"]) > 0
    assert 0 < stats["moe_balance"] <= 1


def test_ep2_seeded_siblings_match_ep1(ep2, reference):
    # n=3 siblings copy their leader's partly filled KV page (page_size 4): slot copies reach the workers.
    outs = ep2.generate(PROMPTS[:3], sampling_params=SAMPLED)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference["sampled"]]


def test_ep2_is_an_executor_and_applies_kv_copies_from_the_batch(ep2, reference, monkeypatch):
    # Data-parallel attention: one scheduler per rank, over that rank's pages; a step is one part per rank.
    pool, scheduler = ep2.executor, ep2.scheduler
    assert [s.allocator for s in scheduler.ranks] == [p.allocator for p in pool.rank_pools] and pool.page_size == 4
    assert all(s.allocator is p.allocator for s, p in zip(scheduler.ranks, pool.rank_pools))
    assert pool.num_slots == pool.rank_pools[0].allocator.num_pages * pool.page_size
    assert pool.can_overlap(ScheduledBatch()) is False
    schedule, num_copies = scheduler.schedule, []

    def schedule_counting_copies():
        batch = schedule()
        assert len(batch.parts) == 2 and not batch.kv_copies
        num_copies.append(sum(len(part.kv_copies) for part in batch.parts))
        return batch

    monkeypatch.setattr(scheduler, "schedule", schedule_counting_copies)
    ep2.flush_cache()
    outs = ep2.generate(PROMPTS[:3], sampling_params=SAMPLED)
    assert sum(num_copies) > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference["sampled"]]


def test_ep2_constrained_rows_match_ep1(ep2, reference):
    # The engine keeps the grammar matchers and ships bitmask rows; the unconstrained row in the batch is untouched.
    outs = ep2.generate(PROMPTS[:2], sampling_params=CONSTRAINED)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference["constrained"]]
    assert outs[0].text.split(" ")[0].isalpha()


def test_worker_started_outside_the_engine(tiny_v3_path, reference):
    # As on a second node: rank 1 is launched by hand (RANK/LOCAL_RANK from the launcher) and joins the pool.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launched = subprocess.Popen([sys.executable, "-m", "deepinfer_rt.distributed.worker", f"tcp://127.0.0.1:{port}"],
                                env=dict(os.environ, RANK="1", LOCAL_RANK="0"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DEEPINFER_EP_LOCAL_WORKERS", "1")
            mp.setenv("DEEPINFER_EP_PORT", str(port))
            with _engine(tiny_v3_path, kv_cache_tokens=4096, ep_size=2) as engine:
                assert len(engine.executor.pids) == 1
                outs = engine.generate(PROMPTS[:3], sampling_params=GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference["greedy"][:3]]
        assert launched.wait(timeout=30) == 0  # the engine's shutdown stopped it
    finally:
        launched.kill()


def test_ep_size_must_divide_experts(tiny_v3_path):
    with pytest.raises(ValueError, match="ep_size=3 must divide"):
        _engine(tiny_v3_path, ep_size=3)


def test_eplb_on_gives_same_tokens_under_chunking_and_retraction(ep2_eplb, reference):
    outs = ep2_eplb.generate(PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference["greedy"]]
    for o, r in zip(outs, reference["greedy"]):
        assert _max_diff(o.logprobs, r.logprobs) < 1e-5
    stats = ep2_eplb.stats
    assert stats["num_retractions"] > 0
    assert stats["eplb_rearrangements"] > 0 and stats["eplb_moved_experts"] > 0


def _assert_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_killed_worker_raises_clear_error(ep2_eplb):
    pids = ep2_eplb.executor.pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    # The step fails, so its requests finish with the pool's error; the engine loop itself goes on.
    outs = ep2_eplb.generate(PROMPTS[:2], sampling_params=GREEDY)
    assert all(o.finish_reason == "error" and re.search(r"worker 1 \(pid \d+\) died with exit code -9", o.error)
               for o in outs)
    assert time.monotonic() - start < 5
    _assert_gone(pids)
    (out,) = ep2_eplb.generate(PROMPTS[:1], sampling_params=GREEDY)
    assert out.finish_reason == "error" and "worker pool is down" in out.error


def test_hung_worker_raises_clear_error(ep2):
    pids = ep2.executor.pids
    ep2.executor.step_timeout_s = 3  # DEEPINFER_EP_STEP_TIMEOUT; a tiny-model step takes milliseconds
    os.kill(pids[0], signal.SIGSTOP)
    start = time.monotonic()
    outs = ep2.generate(PROMPTS[:2], sampling_params=GREEDY)
    assert all(o.finish_reason == "error" and re.search(r"worker\(s\) \[.*0.*\] did not answer within 3 s", o.error)
               for o in outs)
    assert time.monotonic() - start < 8
    _assert_gone(pids)
