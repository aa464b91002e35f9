"""Overlap scheduling through the EP worker pool (CPU, gloo; DEEPINFER_OVERLAP=1 forces it on the CPU): a decode
step is launched before the step before is collected, the workers read its input tokens on their device and
answer the held step when the next one arrives (or a flush). Tokens equal the single-process engine's without
overlap, greedy and seeded sampling, at EP=1 (one worker) and EP=2 (data-parallel attention)."""
from __future__ import annotations

import pytest

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "def f(x):\n    return", "?"]
PARAMS = [SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=7, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
          SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=9, temperature=1.0, seed=8, ignore_eos=True),
          SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)]


def _engine(path, **kwargs) -> Engine:
    return Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=1024, **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_OVERLAP", "0")
        with _engine(tiny_v3_path) as engine:
            return [o.token_ids for o in engine.generate(PROMPTS, sampling_params=PARAMS)]


@pytest.mark.parametrize("ep_size", [1, 2])
def test_overlapped_pool_steps_match_the_engine(tiny_v3_path, reference, monkeypatch, ep_size):
    monkeypatch.setenv("DEEPINFER_OVERLAP", "1")
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    with _engine(tiny_v3_path, ep_size=ep_size) as engine:
        outs = engine.generate(PROMPTS, sampling_params=PARAMS)
        # A second round after the loop went idle: the held last step was flushed, the pool still in step.
        again = engine.generate(PROMPTS[:2], sampling_params=PARAMS[:2])
        stats = engine.stats
    assert [o.token_ids for o in outs] == reference
    assert [o.token_ids for o in again] == reference[:2]
    assert stats["ep_overlapped_steps"] > 5
