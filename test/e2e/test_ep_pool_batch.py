"""The EP worker pool at one rank at a large batch (CPU, gloo; overlap forced on as on CUDA): 256 requests decode
together through the column-packed step messages and the workers' mirrors, twice on one pool (the second round's
requests replace the first's mirrors), with the in-process engine's greedy tokens."""
from __future__ import annotations

import random

from deepinfer_rt import Engine, SamplingParams

PARAMS = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(rng.randrange(2, 6))] for _ in range(256)]


def _tokens(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=PARAMS)]


def test_batch_256_pool_equals_in_process(tiny_v3_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_OVERLAP", "1")
    kwargs = dict(dtype="float32", page_size=1, kv_cache_tokens=256 * 16, max_num_seqs=256)
    rounds = [_prompts(0), _prompts(1)]
    with Engine(str(tiny_v3_path), **kwargs) as engine:
        expected = [_tokens(engine, prompts) for prompts in rounds]
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    with Engine(str(tiny_v3_path), **kwargs) as engine:
        got = [_tokens(engine, prompts) for prompts in rounds]
        stats = engine.stats
    assert got == expected
    assert stats["ep_overlapped_steps"] >= 2 * 3  # the decode steps of both rounds ran overlapped
    assert stats["ep_decode_steps"] >= 2 * 3 and stats["ep_graph_decode_steps"] == 0  # the worker's count (CPU)
