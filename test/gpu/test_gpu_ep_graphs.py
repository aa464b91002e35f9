"""Decode CUDA graphs on every rank at EP=2 (two GPUs, NCCL): the MoE layers' capture-safe all-to-alls inside the
graphs (distributed/ep.py), every rank replaying the same graph size each decode step. Tiny DeepSeek-V3 (fp32):
greedy tokens equal EP=1's (the in-process engine, its own graphs), every rank replays graphs, in batch-invariant
mode tokens and logprobs are the eager exact exchange's bitwise (DEEPINFER_EP_CUDA_GRAPHS=0), and a capacity too
small for the routing fails the requests with the overflow error.

NCCL cannot put two ranks on one GPU, so this needs two GPUs (device kind nvidia-h200-x2); on one H200 it skips
(the capture-safe exchange itself is checked on the CPU: test/unit/test_ep_exchange.py, test/e2e/
test_ep_padded_exchange.py)."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="EP=2 with CUDA graphs needs two GPUs (NCCL puts one rank per GPU)")


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("v3"), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


def _run(path, error: bool = False, **kwargs):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (5, 17, 40, 3, 9, 26)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
              for n in (12, 7, 12, 3, 10, 12)]
    with Engine(str(path), device="cuda", dtype="float32", **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        if error:
            return outs, None
        stats = engine.stats
    return [(o.token_ids, o.logprobs) for o in outs], stats


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_ep2_graphs_on_every_rank_give_ep1_tokens(v3_path, monkeypatch, overlap):
    monkeypatch.setenv("DEEPINFER_OVERLAP", overlap)
    want, _ = _run(v3_path)
    got, stats = _run(v3_path, ep_size=2)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb)) < 1e-3
    assert min(stats["ep_graph_decode_steps_per_rank"]) > 0, stats
    assert stats["ep_padded_steps"] >= stats["ep_graph_decode_steps"] > 0, stats


def test_ep2_graphs_batch_invariant_are_the_eager_exact_steps_bitwise(v3_path, monkeypatch):
    """Batch-invariant mode: the graphs' capture-safe exchange gives the eager exact exchange's tokens and
    logprobs bit for bit, and EP=1's tokens."""
    ep1, _ = _run(v3_path, batch_invariant=True)
    got, stats = _run(v3_path, ep_size=2, batch_invariant=True)
    monkeypatch.setenv("DEEPINFER_EP_CUDA_GRAPHS", "0")
    want, eager = _run(v3_path, ep_size=2, batch_invariant=True)
    assert got == want
    assert [t for t, _ in got] == [t for t, _ in ep1]
    assert min(stats["ep_graph_decode_steps_per_rank"]) > 0 and eager["ep_graph_decode_steps"] == 0, stats


def test_ep2_graphs_off_runs_the_exact_exchange(v3_path, monkeypatch):
    want, _ = _run(v3_path)
    monkeypatch.setenv("DEEPINFER_EP_CUDA_GRAPHS", "0")
    got, stats = _run(v3_path, ep_size=2)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert stats["ep_graph_decode_steps"] == 0 and stats["ep_padded_steps"] == 0, stats


def test_ep2_capacity_overflow_fails_loudly(v3_path, monkeypatch):
    """Blocks of a tenth of the even share under routing skewed to a few experts: the step fails with the
    overflow error instead of answering tokens computed without some pairs."""
    monkeypatch.setenv("DEEPINFER_EP_CAPACITY_FACTOR", "0.1")
    monkeypatch.setenv("DEEPINFER_MOE_ROUTER_SKEW", "3.0")
    outs, _ = _run(v3_path, ep_size=2, error=True)
    assert all(o.finish_reason == "error" and "dispatch overflow" in o.error for o in outs), [o.error for o in outs]
