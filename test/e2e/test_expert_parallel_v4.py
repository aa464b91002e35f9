"""Expert parallelism on CPU (gloo) for DeepSeek-V4: an EP=2 worker pool against the single-process engine.

The tiny V4 checkpoint has a hash-routed first layer (experts chosen by token id) and learned-routed layers
after it, both running through the same dispatch/combine hook as DeepSeek-V3 (test_expert_parallel.py).
"""
from __future__ import annotations


from deepinfer_rt import Engine, SamplingParams

PROMPTS = ["Hello", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12", "?",
           "A long time ago in a galaxy far, far away, there was a small robot."]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=True)


def _generate(path, ep_size: int):
    with Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=2048, ep_size=ep_size) as engine:
        return engine.generate(PROMPTS, sampling_params=GREEDY), engine.stats


def _max_diff(a: list, b: list) -> float:
    return max((abs(x - y) for x, y in zip(a, b) if x is not None), default=0.0)


def test_v4_ep2_greedy_tokens_and_logprobs_match_ep1(tiny_v4_path):
    ref, _ = _generate(tiny_v4_path, 1)
    outs, stats = _generate(tiny_v4_path, 2)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o, r in zip(outs, ref):
        assert len(o.logprobs) == len(r.logprobs) == GREEDY.max_new_tokens
        assert _max_diff(o.logprobs, r.logprobs) < 1e-5
        assert _max_diff(o.prompt_logprobs, r.prompt_logprobs) < 1e-5
    assert stats["ep_size"] == 2 and min(stats["ep_tokens_per_rank"]) > 0


def test_v4_dummy_weights_same_for_ep1_and_ep2_pools(tiny_v4_path, monkeypatch):
    # Sharded dummy init draws each expert from its own seed and the hash table by the model's rule, so one
    # worker and two workers hold the same model.
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=True)
    outs = []
    for ep_size in (1, 2):
        with Engine(str(tiny_v4_path), dtype="float32", load_format="dummy", kv_cache_tokens=512,
                    ep_size=ep_size) as engine:
            outs.append(engine.generate(PROMPTS[:2], sampling_params=params))
            assert engine.stats["ep_size"] == ep_size
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    for o, r in zip(*outs):
        assert _max_diff(o.logprobs, r.logprobs) < 1e-5
