"""Prefix cache on vs off: identical greedy outputs under heavy sharing, eviction, chunking and retraction,
for both KV layouts (GQA: tiny Llama, MLA latent: tiny DeepSeek-V3)."""
from __future__ import annotations

import random

import pytest

from deepinfer_rt import Engine, SamplingParams


def shared_workload(vocab: int, seed: int) -> list[list[int]]:
    """Prompts built from a few shared headers, with partial-node matches (shared headers cut at random
    points) and repeats of whole prompts."""
    rng = random.Random(seed)
    headers = [[rng.randrange(10, vocab) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    prompts = []
    for _ in range(24):
        h = rng.choice(headers)
        cut = rng.randint(5, len(h))
        prompts.append(h[:cut] + [rng.randrange(10, vocab) for _ in range(rng.randint(1, 12))])
    prompts += prompts[:4]  # exact repeats
    return prompts


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_v3_path"])
@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(kv_cache_tokens=300, chunked_prefill_tokens=16),  # eviction + chunked prefill + retraction
    dict(page_size=4, kv_cache_tokens=600),
])
def test_cache_on_equals_cache_off(request, model, kwargs):
    path = request.getfixturevalue(model)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with Engine(str(path), dtype="float32", enable_prefix_cache=False, kv_cache_tokens=8192) as off:
        prompts = shared_workload(off.model_config.vocab_size, seed=0)
        expected = [o.token_ids for o in off.generate(input_ids=prompts, sampling_params=sp)]
    with Engine(str(path), dtype="float32", **kwargs) as on:
        outs = []
        for i in range(0, len(prompts), 7):  # several waves so later ones hit what earlier ones cached
            outs += on.generate(input_ids=prompts[i : i + 7], sampling_params=sp)
        assert [o.token_ids for o in outs] == expected
        assert sum(o.cached_tokens for o in outs) > 0
        stats = on.stats
        assert stats["num_hit_tokens"] > 0 and 0 < stats["hit_rate"] <= 1
        if "kv_cache_tokens" in kwargs and kwargs["kv_cache_tokens"] < 500:
            assert stats["num_evicted_pages"] > 0
        assert on.pool.allocator.num_free + on.cache.num_cached_pages == on.pool.allocator.num_pages
        on.flush_cache()
        assert on.pool.allocator.num_free == on.pool.allocator.num_pages


def test_cached_tokens_reported_and_page_aligned(tiny_llama_path):
    sp = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    with Engine(str(tiny_llama_path), dtype="float32", page_size=4, kv_cache_tokens=1024) as e:
        header = list(range(100, 130))  # 30 tokens
        e.generate(input_ids=[header + [5, 6]], sampling_params=sp)
        out = e.generate(input_ids=[header + [7, 8, 9]], sampling_params=sp)[0]
        assert out.cached_tokens == 28  # 30 shared tokens, floored to 4-token pages
        assert e.generate(input_ids=[[1, 2, 3]], sampling_params=sp)[0].cached_tokens == 0


def test_soak_many_requests_small_pool(tiny_llama_path):
    """Hundreds of requests with random shared prefixes and lengths on a small pool: all finish, no leak."""
    rng = random.Random(3)
    heads = [[rng.randrange(10, 1000) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    prompts = [rng.choice(heads)[: rng.randint(1, 40)] + [rng.randrange(10, 1000) for _ in range(rng.randint(1, 9))]
               for _ in range(400)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 6), temperature=1.0, seed=i, ignore_eos=True)
              for i in range(400)]
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=256, chunked_prefill_tokens=64,
                max_num_seqs=16) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        assert all(o.finish_reason == "length" and len(o.token_ids) == p.max_new_tokens
                   for o, p in zip(outs, params))
        e.flush_cache()
        assert e.pool.allocator.num_free == e.pool.allocator.num_pages
