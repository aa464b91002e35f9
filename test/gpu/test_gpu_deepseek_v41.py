"""DeepSeek-V4.1 on CUDA (CUDA only): the engine's greedy tokens on the GPU in fp32 equal the plain reference
forward's (test/reference/deepseek_v41_ref.py, on the CPU) on both tiny configs, with chunked prefill and pages;
bf16 on the GPU runs and its first token agrees with fp32 on most prompts. Attention and the indexer run through
the Triton kernels there (V41TritonMethod, the CUDA default): the GPU engine's greedy tokens in fp32 equal the CPU
engine's (torch forms), on the 16-bit, the FP8 (kv_cache_dtype='fp8_e4m3') and the MXFP4-entry ('fp4_e2m1') compact
pool."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MAX_NEW = 6
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_ids(i, n) for i, n in enumerate((1, 5, 13, 30, 41, 64, 90, 120))]


def _generate(path, dtype="float32", **kwargs):
    # 16 running requests at most: graphs for batches 1-16 only (each new batch size autotunes the fused MoE)
    with Engine(str(path), device="cuda", dtype=dtype, kv_cache_tokens=4096, max_num_seqs=16, **kwargs) as engine:
        return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.parametrize("variant", ["a", "b"])
def test_cuda_fp32_greedy_equals_oracle(tiny_v41_paths, v41_oracles, variant):
    tokens = _generate(tiny_v41_paths[variant])
    oracle = v41_oracles[variant]
    for prompt, got in zip(PROMPTS, tokens):
        assert len(got) == MAX_NEW
        logits = oracle.logits(prompt + got[:-1])
        assert logits[len(prompt) - 1 :].argmax(dim=-1).tolist() == got, f"prompt of {len(prompt)} tokens"


def test_cuda_chunks_and_pages_equal_default(tiny_v41_paths):
    assert _generate(tiny_v41_paths["a"], chunked_prefill_tokens=7, page_size=4) == _generate(tiny_v41_paths["a"])


def test_cuda_bf16_runs(tiny_v41_paths):
    fp32, bf16 = _generate(tiny_v41_paths["a"]), _generate(tiny_v41_paths["a"], dtype="bfloat16")
    assert all(len(t) == MAX_NEW for t in bf16)
    assert sum(a[0] == b[0] for a, b in zip(fp32, bf16)) >= len(PROMPTS) // 2


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("variant", ["a", "b"])
def test_cuda_triton_method_greedy_equals_cpu_engine(tiny_v41_paths, variant, kv_cache_dtype, monkeypatch):
    from deepinfer_rt.models.deepseek_v41.methods import V41TritonMethod

    path = tiny_v41_paths[variant]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, logprobs=True)
    kw = dict(dtype="float32", kv_cache_tokens=4096, max_num_seqs=16, chunked_prefill_tokens=11,
              kv_cache_dtype=kv_cache_dtype)
    with Engine(str(path), device="cpu", **kw) as cpu:
        ref = cpu.generate(input_ids=PROMPTS, sampling_params=params)
    with Engine(str(path), device="cuda", **kw) as gpu:
        methods = {type(layer.attn.method) for layer in gpu.model.model.layers}
        assert methods == {V41TritonMethod}, methods
        assert gpu.pool.layout.kv_dtype == kv_cache_dtype
        out = gpu.generate(input_ids=PROMPTS, sampling_params=params)
    for prompt, o, r in zip(PROMPTS, out, ref):
        assert o.token_ids == r.token_ids, f"prompt of {len(prompt)} tokens"
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 2e-2
