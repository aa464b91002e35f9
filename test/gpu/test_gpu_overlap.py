"""Overlap scheduling on CUDA (skipped without a GPU): the launch of an overlapped decode step (CUDA graph
inputs, replay, LM head, sampling) raises under the sync debug mode if anything in it waits for the GPU, and
outputs equal the synchronous engine's."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=30, min_p=0.01, seed=1,
                         ignore_eos=True),
          SamplingParams(max_new_tokens=7, temperature=0.0)]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


def _generate(path, overlap: bool, monkeypatch):
    monkeypatch.setenv("DEEPINFER_OVERLAP", "1" if overlap else "0")
    with Engine(str(path), device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=8) as engine:
        assert engine.executor.is_overlap_enabled == overlap
        return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    """Tiny DeepSeek-V3 (MLA + MoE kernels) with the DeepSeek tokenizer the GPU machine carries."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("tiny-v3"), seed=0)


def test_gpu_overlapped_launch_never_syncs(tiny_path, monkeypatch):
    launch, launches = ModelRunner._launch_overlapped, []

    def guarded(self, batch, prev):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launches.append(prev is not None)
            return launch(self, batch, prev)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(ModelRunner, "_launch_overlapped", guarded)
    overlapped = _generate(tiny_path, True, monkeypatch)
    assert sum(launches) >= 6
    monkeypatch.undo()
    assert overlapped == _generate(tiny_path, False, monkeypatch)


def test_gpu_graph_draws_equal_the_sampler(tiny_path, monkeypatch):
    """Batches of greedy and plain temperature rows take their tokens from the graph's own draw (one kernel at the
    graph's end); the synchronous engine samples the same graph's logits on the host's side (the sampler) and
    gets the same tokens, and a seed's tokens do not depend on the rows beside it."""
    params = [SamplingParams(max_new_tokens=12, temperature=0.7, seed=3, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_new_tokens=12, temperature=1.3, seed=4, ignore_eos=True)]
    taken = []
    launch = ModelRunner._launch_overlapped

    def counted(self, batch, prev):
        out = launch(self, batch, prev)
        taken.append(out.tokens.data_ptr() == self.graphs.next_tokens.data_ptr())
        return out

    def generate(overlap: bool, prompts, sp):
        monkeypatch.setenv("DEEPINFER_OVERLAP", "1" if overlap else "0")
        with Engine(str(tiny_path), device="cuda", dtype="float32", kv_cache_tokens=4096, max_num_seqs=8) as engine:
            assert engine.executor.is_overlap_enabled == overlap
            return [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=sp)]

    monkeypatch.setattr(ModelRunner, "_launch_overlapped", counted)
    drawn = generate(True, PROMPTS, params)
    assert sum(taken) >= 8  # decode steps whose tokens the graph drew
    monkeypatch.setattr(ModelRunner, "_launch_overlapped", launch)
    assert drawn == generate(False, PROMPTS, params)
    alone = generate(True, PROMPTS[2:], params[2:])
    assert alone[0] == drawn[2]
    assert len(set(map(tuple, drawn))) == 3
