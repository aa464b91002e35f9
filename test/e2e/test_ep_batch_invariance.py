"""Batch invariance under expert parallelism (CPU, gloo): with the switch on, a needle prompt's tokens and
logprobs from an EP=2 worker pool are the same alone and inside random batches, while EPLB moves experts
between ranks every two steps (with one redundant copy per rank), so the same token meets different placements,
rank splits and per-expert row counts. The combine sums a token's expert outputs in top-k order whatever rank
computed them, and every expert GEMM is the fixed-tile form, so none of that may change a bit."""
from __future__ import annotations

import random


from deepinfer_rt import Engine, SamplingParams

_GREEDY = SamplingParams(max_new_tokens=3, temperature=0.0, logprobs=True, ignore_eos=True)
_SAMPLED = SamplingParams(max_new_tokens=3, temperature=1.0, seed=99, logprobs=True, ignore_eos=True)


def _needle_key(engine: Engine, needle: list[int], others: list[list[int]], rng: random.Random):
    prompts = [(p, SamplingParams(max_new_tokens=rng.randrange(1, 5), ignore_eos=True)) for p in others]
    for params in (_GREEDY, _SAMPLED):
        prompts.insert(rng.randrange(len(prompts) + 1), (needle, params))
    outs = engine.generate(input_ids=[p for p, _ in prompts], sampling_params=[sp for _, sp in prompts])
    by_params = {id(sp): out for out, (_, sp) in zip(outs, prompts)}
    return tuple((tuple(by_params[id(sp)].token_ids), tuple(by_params[id(sp)].logprobs)) for sp in (_GREEDY, _SAMPLED))


def test_ep2_needle_is_batch_invariant_while_eplb_moves_experts(tiny_v3_path, monkeypatch):
    for name, value in [("DEEPINFER_EPLB", "1"), ("DEEPINFER_EPLB_INTERVAL", "2"), ("DEEPINFER_EPLB_WINDOW", "4"),
                        ("DEEPINFER_EPLB_REDUNDANT", "1")]:
        monkeypatch.setenv(name, value)
    # The CPU invariant GEMMs check their tile plan once per weight shape and process (layers/invariant_gemm.py):
    # with one thread per worker on a shared CPU the first step takes 15-30 s, at the default 30 s step timeout.
    monkeypatch.setenv("DEEPINFER_EP_STEP_TIMEOUT", "180")
    rng = random.Random(3)
    with Engine(str(tiny_v3_path), dtype="float32", page_size=4, kv_cache_tokens=4096, ep_size=2,
                batch_invariant=True, enable_prefix_cache=False) as engine:
        vocab = engine.model_config.vocab_size
        needle = [rng.randrange(3, vocab) for _ in range(30)]
        keys = {_needle_key(engine, needle, [], rng)}
        for _ in range(8):
            others = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 12))]
            keys.add(_needle_key(engine, needle, others, rng))
        moved = engine.stats["eplb_moved_experts"]
    assert moved > 0, "EPLB never moved an expert: the test would not cover changing placements"
    assert len(keys) == 1, f"{len(keys)} distinct needle outputs"
