"""Speculation through the EP worker pool (CPU, gloo): drafts planned in the engine process, verified in the
worker serving the request. Random tiny models rarely repeat themselves, so the drafter is the oracle of
test_speculative.py (the reference continuation, some positions corrupted: partial acceptance and rollback
every step). Tokens equal the engine's without speculation, and the drafted/accepted counts equal the
single-process engine's with the same drafter, at EP=1 (one worker) and EP=2 (data-parallel attention)."""
from __future__ import annotations

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative import SpeculativeConfig

from test_speculative import OracleDrafter

PROMPTS = [[5, 17, 300, 9, 17, 300, 9, 44, 81, 2000], [100, 200, 300, 400, 100, 200, 7, 8],
           list(range(1000, 1040)), [42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58]]
PARAMS = [SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
          SamplingParams(max_new_tokens=9, temperature=0, ignore_eos=True)]


def _run(path, speculative=None, **kwargs):
    with Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=1024, speculative=speculative,
                **kwargs) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
        return [o.token_ids for o in outs], engine.stats.get("spec")


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    plain, _ = _run(tiny_v3_path)
    oracle = SpeculativeConfig(drafter=OracleDrafter({tuple(p): o for p, o in zip(PROMPTS, plain)}), max_draft=4)
    speculated, stats = _run(tiny_v3_path, oracle)
    assert speculated == plain and 0 < stats["accepted"] < stats["drafted"], stats
    return plain, oracle, stats


@pytest.mark.parametrize("ep_size", [1, 2])
def test_speculation_under_ep_equals_speculation_without(tiny_v3_path, reference, monkeypatch, ep_size):
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    plain, oracle, stats = reference
    outs, ep_stats = _run(tiny_v3_path, oracle, ep_size=ep_size)
    assert outs == plain
    assert ep_stats == stats


def test_a_drafter_reading_the_model_is_refused_under_ep(tiny_v3_path):
    with pytest.raises(ValueError, match="speculative='mtp' does not run with the expert-parallel worker pool"):
        Engine(str(tiny_v3_path), dtype="float32", ep_size=2, speculative="mtp")
