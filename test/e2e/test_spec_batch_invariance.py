"""Speculative decoding in fixed-length mode keeps batch invariance: with prompt lookup drafting, a needle's
tokens and draft statistics are bitwise the same alone and inside random batches, with random chunk sizes and
batch caps and a cold or warm prefix cache. The number of drafts verified depends only on the request as long as
the step's token budget has room for them (a small chunked-prefill budget truncates drafts, which changes the
draft statistics but never the tokens), so statistics are compared only under the large budget."""
from __future__ import annotations

import dataclasses
import random

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative.config import SpeculativeConfig

_GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
_SAMPLED = SamplingParams(max_new_tokens=12, temperature=1.0, seed=99, ignore_eos=True)


def _run(engine: Engine, needle: list[int], others: list[list[int]], rng: random.Random):
    prompts = [(p, SamplingParams(max_new_tokens=rng.randrange(1, 12), temperature=rng.choice([0.0, 0.8]),
                                  ignore_eos=True)) for p in others]
    for params in (_GREEDY, _SAMPLED):
        prompts.insert(rng.randrange(len(prompts) + 1), (needle, params))
    outs = engine.generate(input_ids=[p for p, _ in prompts], sampling_params=[sp for _, sp in prompts])
    greedy = next(o for o, (_, sp) in zip(outs, prompts) if sp is _GREEDY)
    sampled = next(o for o, (_, sp) in zip(outs, prompts) if sp is _SAMPLED)
    return (tuple(greedy.token_ids), tuple(sampled.token_ids)), (greedy.spec_stats, sampled.spec_stats)


def test_fixed_length_prompt_lookup_is_batch_invariant(tiny_llama_path):
    rng = random.Random(11)
    motif = [rng.randrange(3, 1000) for _ in range(6)]
    needle = motif * 4 + [rng.randrange(3, 1000) for _ in range(5)] + motif[:3]  # repeats for lookup to find
    spec = SpeculativeConfig("prompt_lookup", fixed_length=True, max_draft=4)
    with Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=4096, batch_invariant=True,
                speculative=spec) as engine:
        alone, alone_stats = _run(engine, needle, [], rng)
        for chunk in (5, 2048, 16, 2048):
            engine.scheduler.config = dataclasses.replace(
                engine.scheduler.config, chunked_prefill_tokens=chunk, max_num_seqs=rng.choice([2, 256]))
            if rng.random() < 0.5:
                engine.flush_cache()
            others = [(motif * 3 if rng.random() < 0.5 else []) + [rng.randrange(3, 1000) for _ in range(
                rng.randrange(1, 30))] for _ in range(rng.randrange(1, 8))]
            tokens, stats = _run(engine, needle, others, rng)
            assert tokens == alone
            if chunk == 2048:
                assert stats == alone_stats
    # The greedy needle really was speculated (prompt lookup may find nothing in the sampled copy's output).
    assert alone_stats[0]["drafted"] > 0, alone_stats
