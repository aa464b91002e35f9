"""The whole engine with MLA prefill forced into the standard (MHA) form: greedy tokens equal transformers'
(tiny DeepSeek-V3, fp32), through fresh prompts, chunked prefill mixed with decode rows, and prefix-cache hits."""
from __future__ import annotations

import random

import pytest
import torch
from helpers import hf_greedy

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.layers import mla_prefill


@pytest.fixture
def plans(monkeypatch) -> list[mla_prefill.MLAPrefillPlan]:
    """Force the MHA form; record the plan of each batch."""
    monkeypatch.setenv("DEEPINFER_MLA_MHA_PREFILL", "1")
    seen, inner = [], mla_prefill.build_plan

    def record(batch, min_queries):
        seen.append(inner(batch, min_queries))
        return seen[-1]

    monkeypatch.setattr(mla_prefill, "build_plan", record)
    return seen


def test_engine_mha_prefill_matches_transformers(tiny_v3_path, plans):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_v3_path, dtype=torch.float32).eval()
    sp = SamplingParams(max_new_tokens=6, temperature=0)
    rng = random.Random(0)
    with Engine(str(tiny_v3_path), dtype="float32", kv_cache_tokens=2048, chunked_prefill_tokens=24) as engine:
        vocab = engine.model_config.vocab_size
        header = [rng.randrange(10, vocab) for _ in range(30)]
        first = [[rng.randrange(10, vocab) for _ in range(n)] for n in (5, 40, 13)]
        # The second wave repeats the header (prefix-cache hits) and arrives in one chunked batch.
        second = [header + [rng.randrange(10, vocab) for _ in range(n)] for n in (3, 20)]
        prompts = [header + first[0]] + first[1:] + second
        outs = engine.generate(input_ids=prompts[:3], sampling_params=sp)
        outs += engine.generate(input_ids=prompts[3:], sampling_params=sp)
        with torch.no_grad():
            expected = [hf_greedy(ref, p, 6, engine.eos_ids) for p in prompts]
        assert [o.token_ids for o in outs] == expected
        assert sum(o.cached_tokens for o in outs[3:]) >= 2 * 30 - 2
    # Some steps mixed decode rows (absorbed) with prompt chunks (MHA), some chunks sat on a cached prefix.
    assert any(p.segments and p.absorbed is not None and 1 in p.absorbed.q_lens for p in plans)
    assert any(s.mask is not None for p in plans for s in p.segments)
