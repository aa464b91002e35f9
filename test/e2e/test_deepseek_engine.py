"""Tiny random DeepSeek-V3 through the whole engine vs transformers generate (greedy, fp32)."""
from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy

from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "def f(x):\n    return",
           "A long time ago in a galaxy far, far away, there was a small robot.", "?", "ok ok ok ok",
           "The quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module", params=["q_lora", "no_q_lora"])
def v3_path(request, tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint

    overrides = {} if request.param == "q_lora" else {"q_lora_rank": None}
    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp(request.param), seed=1, **overrides)


def test_engine_greedy_matches_transformers(v3_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(v3_path, dtype=torch.float32).eval()
    with Engine(str(v3_path), dtype="float32", kv_cache_tokens=2048) as engine:
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        with torch.no_grad():
            expected = [hf_greedy(ref, x, 12, engine.eos_ids) for x in ids]
        outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=12, temperature=0))
        assert [o.token_ids for o in outs] == expected
        # MLA layout: the pool holds one latent+rope row per token, not per-head K/V.
        cfg = engine.model_config
        assert engine.pool.k[0].shape[1:] == (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        lp = engine.generate(input_ids=ids[2:3], sampling_params=SamplingParams(
            max_new_tokens=1, temperature=0, prompt_logprobs=True))[0].prompt_logprobs
        with torch.no_grad():
            ref_lp = ref(torch.tensor(ids[2:3])).logits[0].float().log_softmax(-1)
        want = [ref_lp[j, ids[2][j + 1]].item() for j in range(len(ids[2]) - 1)]
        assert max(abs(a - b) for a, b in zip(lp[1:], want)) < 1e-4


def test_engine_same_outputs_under_retraction_and_chunking(v3_path):
    sp = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    with Engine(str(v3_path), dtype="float32", kv_cache_tokens=4096) as engine:
        alone = [engine.generate([p], sampling_params=sp)[0].token_ids for p in PROMPTS]
    with Engine(str(v3_path), dtype="float32", kv_cache_tokens=48, chunked_prefill_tokens=5) as engine:
        outs = engine.generate(PROMPTS, sampling_params=sp)
        assert [o.token_ids for o in outs] == alone
        assert engine.stats["num_retractions"] > 0
        assert engine.pool.allocator.num_free + engine.cache.num_cached_pages == engine.pool.allocator.num_pages
