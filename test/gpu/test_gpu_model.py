"""Whole-model checks on GPU (CUDA only): the Triton/CUDA-graph engine against the CPU reference engine on
tiny random checkpoints, graph replay against eager, and no host sync inside a graph decode step."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KINDS = ("llama", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module", params=KINDS)
def tiny_path(request, tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    # Every kind takes the DeepSeek tokenizer here: the GPU machine has no SmolLM2 package.
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 40)]


def _generate(engine: Engine, prompts) -> list:
    params = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
    return engine.generate(input_ids=prompts, sampling_params=params)


def _engine(path, device: str) -> Engine:
    return Engine(str(path), dtype="float32", device=device, kv_cache_tokens=4096, max_num_seqs=8,
                  enable_prefix_cache=False)


def test_gpu_engine_matches_cpu_reference(tiny_path):
    with _engine(tiny_path, "cpu") as cpu:
        prompts = _prompts(cpu.model_config.vocab_size)
        ref = _generate(cpu, prompts)
    with _engine(tiny_path, "cuda") as gpu:
        assert gpu.executor.graphs is not None
        out = _generate(gpu, prompts)
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 2e-2


def _count_graph_runs(engine: Engine, monkeypatch, guard: bool) -> list[int]:
    """Wrap the graph runner: count replays; with guard, any host sync inside a decode step raises."""
    graphs, runs = engine.executor.graphs, [0]
    inner = graphs.run

    def run(batch, *args):
        if guard:
            torch.cuda.set_sync_debug_mode("error")
        try:
            hidden = inner(batch, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        runs[0] += hidden is not None
        return hidden

    monkeypatch.setattr(graphs, "run", run)
    return runs


def test_graph_replay_matches_eager(tiny_path, monkeypatch):
    with _engine(tiny_path, "cuda") as gpu:
        prompts = _prompts(gpu.model_config.vocab_size)
        runs = _count_graph_runs(gpu, monkeypatch, guard=False)
        graphed = _generate(gpu, prompts)
    assert runs[0] > 0
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "0")
    with _engine(tiny_path, "cuda") as eager:
        assert eager.executor.graphs is None
        ref = _generate(eager, prompts)
    for o, r in zip(graphed, ref):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-3


def test_graph_decode_step_has_no_host_sync(tiny_path, monkeypatch):
    with pytest.raises(RuntimeError):  # the guard itself works: an explicit sync raises
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ones(1, device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with _engine(tiny_path, "cuda") as gpu:
        runs = _count_graph_runs(gpu, monkeypatch, guard=True)
        _generate(gpu, _prompts(gpu.model_config.vocab_size))
    assert runs[0] > 0
