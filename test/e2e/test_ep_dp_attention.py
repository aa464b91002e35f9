"""Data-parallel attention under expert parallelism (CPU, gloo), tiny DeepSeek-V3: each EP rank serves its own
requests with its own KV pool and prefix cache, and every rank runs each MoE layer together (a rank without
requests runs an empty step). EP=2 against EP=1 is in test_expert_parallel.py (its pools run DP attention too).
"""
from __future__ import annotations

import random

import pytest

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.request import Req

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "def f(x):\n    return",
           "A long time ago in a galaxy far, far away", "?", "ok ok ok ok", "The quick brown fox"]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True)


def _engine(path, **kwargs) -> Engine:
    return Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=2048, **kwargs)


@pytest.fixture(scope="module")
def reference(tiny_v3_path):
    with _engine(tiny_v3_path) as engine:
        yield engine.generate(PROMPTS, sampling_params=GREEDY)


@pytest.fixture(scope="module")
def ep4(tiny_v3_path):
    with _engine(tiny_v3_path, ep_size=4) as engine:
        yield engine


def test_ep4_greedy_matches_ep1_and_every_rank_serves(ep4, reference):
    served = list(ep4.scheduler.num_served)
    outs = ep4.generate(PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    diff = max(abs(a - b) for o, r in zip(outs, reference) for a, b in zip(o.logprobs, r.logprobs))
    assert diff < 1e-4
    assert all(now > before for now, before in zip(ep4.scheduler.num_served, served)), ep4.scheduler.num_served
    stats = ep4.stats
    assert stats["ep_size"] == 4 and min(stats["ep_tokens_per_rank"]) > 0


def test_prompt_logprobs_under_ep4_match_ep1(tiny_v3_path, ep4):
    """Each rank scores the prompts it serves (its own KV and rows); a prompt longer than the chunk budget is
    scored across chunks. Values and the top-3 alternatives equal the single process's."""
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (5, 23, 2, 40, 11, 17)]
    with _engine(tiny_v3_path, chunked_prefill_tokens=16) as engine:
        expected = engine.generate(input_ids=prompts, sampling_params=params)
    outs = ep4.generate(input_ids=prompts, sampling_params=params)
    for out, ref in zip(outs, expected):
        assert out.token_ids == ref.token_ids
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) and out.prompt_logprobs[0] is None
        assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:])) < 1e-4
        for got, want in zip(out.prompt_top_logprobs[1:], ref.prompt_top_logprobs[1:]):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4


def test_lone_request_runs_while_three_ranks_step_empty(ep4, reference):
    (out,) = ep4.generate(PROMPTS[2:3], sampling_params=GREEDY)
    assert out.token_ids == reference[2].token_ids


def test_prefix_aware_placement_hits_the_cache(ep4):
    rng = random.Random(5)
    vocab = ep4.model_config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    ep4.generate(input_ids=[shared + [7]], sampling_params=params)
    probe = Req(-1, shared + [8], params, 0)
    holder = [r for r, cache in enumerate(ep4.scheduler.caches) if cache.peek(probe) >= 40]
    assert len(holder) == 1, "the prompt's prefix is cached on exactly one rank"
    served = list(ep4.scheduler.num_served)
    related = [shared + [rng.randrange(3, vocab) for _ in range(3)] for _ in range(3)]
    unrelated = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(3)]
    outs = ep4.generate(input_ids=related + unrelated, sampling_params=params)
    assert all(o.cached_tokens >= 36 for o in outs[:3]), [o.cached_tokens for o in outs]
    assert all(o.cached_tokens == 0 for o in outs[3:])
    gained = [now - before for now, before in zip(ep4.scheduler.num_served, served)]
    assert gained[holder[0]] >= 3 and sum(gained) == 6
    assert sum(1 for g in gained if g) > 1, "the unrelated requests went elsewhere (balanced by tokens)"


@pytest.mark.parametrize("ep_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_batch_invariant_outputs_identical_across_ep_sizes(tiny_v3_path, monkeypatch, ep_size):
    # The CPU invariant GEMMs check their tile plan once per weight shape and process: a slow first step.
    monkeypatch.setenv("DEEPINFER_EP_STEP_TIMEOUT", "180")
    rng = random.Random(3)
    sampled = SamplingParams(max_new_tokens=4, temperature=1.0, seed=99, logprobs=True, ignore_eos=True)
    with _engine(tiny_v3_path, batch_invariant=True, enable_prefix_cache=False) as engine:
        vocab = engine.model_config.vocab_size
        needle = [rng.randrange(3, vocab) for _ in range(30)]
        alone = [(o.token_ids, o.logprobs) for o in engine.generate(input_ids=[needle, needle],
                                                                   sampling_params=[GREEDY, sampled])]
    others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(7)]
    batch = others[:3] + [needle] + others[3:] + [needle]
    params = [SamplingParams(max_new_tokens=rng.randrange(1, 6), ignore_eos=True) for _ in others]
    with _engine(tiny_v3_path, ep_size=ep_size, batch_invariant=True, enable_prefix_cache=False) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=params[:3] + [GREEDY] + params[3:] + [sampled])
    assert [(outs[3].token_ids, outs[3].logprobs), (outs[-1].token_ids, outs[-1].logprobs)] == alone
