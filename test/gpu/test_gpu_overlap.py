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
