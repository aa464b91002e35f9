"""Weight-only int8 (Engine(quantization="int8"), layers/int8.py) against the dense model whose weights are the
int8 ones dequantized: the same matrices, so only the GEMM's rounding differs."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt import Engine
from deepinfer_rt.layers.int8 import Int8WeightOnlyLinear, dequantized, quantize_rows

from helpers import check_weight_only_matches_dense


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
    check_weight_only_matches_dense(tiny_llama_path, dtype, "int8", Int8WeightOnlyLinear, dequantized)
