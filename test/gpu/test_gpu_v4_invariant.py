"""DeepSeek-V4 and V4.1 engines on CUDA in batch-invariant mode (skipped without a GPU): attention and the indexer
run through the Triton kernels' invariant modes (V4InvariantTritonMethod, V41InvariantTritonMethod), and a
needle's token ids and logprobs (greedy and seeded sampling) are bitwise the same alone and inside random batches
with random chunk sizes; V4 and V4.1 with the 16-bit and the FP8 compact pool."""
from __future__ import annotations

import random

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = [SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True),
          SamplingParams(max_new_tokens=10, temperature=1.0, seed=7, logprobs=True, ignore_eos=True)]


def _tiny(kind: str, tmp_path_factory, **overrides):
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind), seed=0, **overrides)


def _check(path, dtype: str, trials: int, **engine_kw) -> None:
    from deepinfer_rt.models.deepseek_v4.methods import V4InvariantTritonMethod
    from deepinfer_rt.models.deepseek_v41.methods import V41InvariantTritonMethod

    rng = random.Random(5)
    seen = set()
    # 600 tokens: its sliding list (window 300) and V4.1's ratio-1 entries span several 256-key splits
    needle = [random.Random(99).randrange(100, 20000) for _ in range(600)]
    for trial in range(trials):
        chunk = rng.choice([7, 32, 2048])
        with Engine(str(path), dtype=dtype, device="cuda", batch_invariant=True, kv_cache_tokens=32768,
                    max_num_seqs=64, chunked_prefill_tokens=chunk, **engine_kw) as engine:
            if trial == 0:
                methods = {type(m.method) for m in engine.model.modules() if hasattr(m, "method")}
                assert methods & {V4InvariantTritonMethod, V41InvariantTritonMethod}, methods
            others = [[rng.randrange(100, 20000) for _ in range(rng.randrange(3, 400))]
                      for _ in range(rng.choice([0, 3, 15, 40]))]
            at = rng.randrange(len(others) + 1)
            batch = others[:at] + [needle] + others[at:]
            for sp in PARAMS:
                out = engine.generate(input_ids=batch, sampling_params=sp)[at]
                seen.add((sp.temperature, tuple(out.token_ids), tuple(out.logprobs)))
    assert len(seen) == len(PARAMS), "the needle's output changed with its batch"


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_v4_batch_invariant_engine(tmp_path_factory, dtype, kv_cache_dtype):
    path = _tiny("deepseek_v4", tmp_path_factory, sliding_window=300, max_position_embeddings=4096)
    _check(path, dtype, trials=3, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_v41_batch_invariant_engine(tiny_v41_paths, dtype, kv_cache_dtype):
    _check(tiny_v41_paths["a"], dtype, trials=3, kv_cache_dtype=kv_cache_dtype)
