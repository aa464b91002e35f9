"""Weight-only int8 (Engine(quantization="int8"), layers/int8.py) against the dense model whose weights are the
int8 ones dequantized: the same matrices, so only the GEMM's rounding differs."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.layers.int8 import Int8WeightOnlyLinear, dequantized, quantize_rows

PROMPTS = ["The capital of France is", "Hello", "1, 2, 3, 4, 5, 6, 7, 8,"]


def test_quantize_rows_round_trip():
    w = torch.randn(16, 32)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert (q.float() * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-6


def test_int8_refused_where_it_does_not_run(tiny_llama_path):
    with pytest.raises(ValueError, match="int8"):
        Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=256, quantization="int8", batch_invariant=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_matches_dequantized_reference(tiny_llama_path, dtype):
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    with Engine(str(tiny_llama_path), dtype=dtype, kv_cache_tokens=1024, quantization="int8") as q8:
        linears = {n: m for n, m in q8.model.named_modules() if isinstance(getattr(m, "method", None),
                                                                            Int8WeightOnlyLinear)}
        assert linears and all(m.weight.numel() == 0 for m in linears.values())  # the dense copy is dropped
        got = q8.generate(PROMPTS, sampling_params=sp)
        with Engine(str(tiny_llama_path), dtype=dtype, kv_cache_tokens=1024) as ref:
            with torch.no_grad():
                for name, module in ref.model.named_modules():
                    if name in linears:
                        module.weight.copy_(dequantized(linears[name]))
            want = ref.generate(PROMPTS, sampling_params=sp)
    tol = 2e-3 if dtype == "float32" else 0.1
    for a, b in zip(got, want):
        errors = [abs(x - y) for x, y in zip(a.prompt_logprobs[1:] + a.logprobs[:1],
                                             b.prompt_logprobs[1:] + b.logprobs[:1])]
        assert max(errors) < tol, (dtype, max(errors))
        assert a.token_ids[:2] == b.token_ids[:2]  # a later near-tie may go either way
