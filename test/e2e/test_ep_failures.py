"""A failing EP rank under data-parallel attention (CPU, gloo): killed or hung (stopped), it ends every
request, the waiting ones too, with an error naming it, within the step timeout; a capture-safe exchange whose
capacity the routing overflows fails its step's requests with the overflow error."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "def f(x):\n    return",
           "A long time ago in a galaxy far, far away", "?"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)


def _engine(path, **kwargs) -> Engine:
    return Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=2048, **kwargs)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_rank_failure_ends_every_waiting_request_with_a_clear_error(tiny_v3_path, how):
    # One request at a time per rank: four of the six wait when rank 1 fails.
    with _engine(tiny_v3_path, ep_size=2, max_num_seqs=1) as engine:
        pid = engine.executor.pids[1]
        engine.executor.step_timeout_s = 3  # DEEPINFER_EP_STEP_TIMEOUT; a tiny-model step takes milliseconds
        os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        outs = engine.generate(PROMPTS[:6], sampling_params=GREEDY)
        elapsed = time.monotonic() - start
    # A rank waiting in a collective for the stopped one does not answer either.
    cause = (re.escape(f"worker 1 (pid {pid}) died with exit code -9") if how == "killed"
             else r"worker\(s\) \[(0, )?1\] did not answer within 3 s")
    assert all(o.finish_reason == "error" and re.search(cause, o.error) for o in outs), [o.error for o in outs]
    assert elapsed < (5 if how == "killed" else 3 + 5)


def test_capacity_overflow_fails_the_requests_loudly(tiny_v3_path, monkeypatch):
    """Blocks of a tenth of the even share under routing skewed to a few experts: the decode step fails with the
    overflow error on every rank instead of answering tokens computed without some pairs."""
    monkeypatch.setenv("DEEPINFER_EP_PADDED_DISPATCH", "1")
    monkeypatch.setenv("DEEPINFER_EP_CAPACITY_FACTOR", "0.1")
    monkeypatch.setenv("DEEPINFER_MOE_ROUTER_SKEW", "3.0")
    with _engine(tiny_v3_path, ep_size=2) as engine:
        outs = engine.generate(PROMPTS, sampling_params=GREEDY)
    assert all(o.finish_reason == "error" and "dispatch overflow" in o.error for o in outs), [o.error for o in outs]
