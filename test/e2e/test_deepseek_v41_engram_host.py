"""DeepSeek-V4.1 with its Engram tables in host memory (DEEPINFER_V41_ENGRAM_HOST=1): the tables stay on the CPU
whatever device the model is on, each step gathers its rows there, and greedy outputs equal the on-device path."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = [torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (2, 11, 37)]


def _run(path):
    with Engine(str(path), dtype="float32", kv_cache_tokens=1024, chunked_prefill_tokens=16) as engine:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SamplingParams(max_new_tokens=5, temperature=0,
                                                                                 ignore_eos=True))
        layers = [layer.engram for layer in engine.model.model.layers if layer.engram is not None]
        return [o.token_ids for o in outs], layers


def test_host_tables_equal_device_tables(tiny_v41_paths, monkeypatch):
    device, layers = _run(tiny_v41_paths["a"])
    assert layers and not any(e.is_host_table for e in layers)
    monkeypatch.setenv("DEEPINFER_V41_ENGRAM_HOST", "1")
    host, layers = _run(tiny_v41_paths["a"])
    assert layers and all(e.is_host_table and e.embed.weight.device.type == "cpu" for e in layers)
    assert host == device


def test_host_table_follows_dtype_not_device():
    from deepinfer_rt.models.deepseek_v41.engram import Engram

    e = Engram(8, 2, 11, 4, 2, 1e-6, is_host_table=True)
    e.to(dtype=torch.float64)
    assert e.embed.weight.dtype == torch.float64 and e.wkv.weight.dtype == torch.float64
    rows = torch.tensor([[1, 10], [0, 3]])
    torch.testing.assert_close(e.gather(rows), e.embed.weight[rows])
