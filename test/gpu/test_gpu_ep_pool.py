"""The expert-parallel worker pool at one rank on CUDA (CUDA only): its decode CUDA graphs and overlap scheduling in
the worker give the in-process engine's greedy tokens on a tiny DeepSeek-V3 (fp32), and keep replaying round after
round of requests."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("v3"), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


def _tokens(path, **kwargs):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 40, 3)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    with Engine(str(path), device="cuda", dtype="float32", **kwargs) as engine:
        return [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_pool_at_one_rank_equals_in_process(v3_path, monkeypatch, overlap):
    monkeypatch.setenv("DEEPINFER_OVERLAP", overlap)
    expected = _tokens(v3_path)
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    assert _tokens(v3_path) == expected


def test_pool_worker_replays_graphs_round_after_round(v3_path, monkeypatch):
    """Graphs of at most 4 rows (a page table of 8): round after round of 4 requests, every decode step of the
    worker replays a graph (forgotten mirror requests give their table rows back)."""
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "4")
    monkeypatch.setenv("DEEPINFER_EP_WORKER_POOL", "1")
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(str(v3_path), device="cuda", dtype="float32", max_num_seqs=4) as engine:
        for round_ in range(5):
            engine.generate(input_ids=[[round_ * 10 + i + 1] * (i + 2) for i in range(4)], sampling_params=params)
        stats = engine.stats
    assert stats["ep_decode_steps"] >= 5 * 5
    assert stats["ep_graph_decode_steps"] == stats["ep_decode_steps"], stats
