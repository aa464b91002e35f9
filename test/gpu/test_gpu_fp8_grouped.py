"""The grouped (block-diagonal) FP8 GEMM on CUDA (skipped without a GPU): V4 / V4.1's wo_a kept in FP8
(deepinfer_kernels.fp8_gemm's `groups`, layers/fp8.py Fp8BlockLinear.apply_grouped).

- Each path (the split fused kernel, the tiled one, the GEMV form up to 4 rows and auto's path above, `auto`,
  batch-invariant) against the torch form per group
  (reference.fp8_block_gemm: the same activation quantization, exact products, fp32 sums): relative error <= 5e-3
  in norm, as the dense GEMM's GPU test (fp32 sums in another order, the bf16 output rounding, a rare e4m3
  neighbour from the GPU's fp32 division), at V4-Flash's shape (8 groups of 1024 rows over 4096 inputs, 128 x 128
  blocks), V4.1's 32 x 32 blocks and a small odd one.
- Batch-invariant mode: the grouped launch equals the same GEMM run group by group, bit for bit, and a row's
  result does not depend on the other rows.

    pytest test/gpu/test_gpu_fp8_grouped.py
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
SHAPES = {  # (groups, rows a group, inputs a group, scale block)
    "v4_flash_wo_a": (8, 1024, 4096, (128, 128)),
    "v41_blocks": (8, 512, 2048, (32, 32)),
    "small": (3, 48, 256, (128, 128)),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("path", ["triton", "tiled", "gemv", "auto", "invariant"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("m", [1, 16, 64, 2048])
def test_grouped_fp8_gemm_against_reference(path, shape, m):
    from deepinfer_kernels.fp8_gemm import fp8_gemm, fp8_invariant_gemm
    from deepinfer_kernels.reference import fp8_block_gemm as ref_gemm, quantize_fp8_blocks

    groups, rows, k, block = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(m * 13 + rows)
    q, s = quantize_fp8_blocks(torch.randn(groups * rows, k, device=DEV, generator=g) * 0.02, block)
    x = torch.randn(m, groups, k, device=DEV, generator=g).bfloat16()
    x[:, -1] *= 30  # a group of its own activation scale
    x2 = x.reshape(m, groups * k)
    if path == "invariant":
        y = fp8_invariant_gemm(x2, q, s, block[0], block[1], groups=groups)
    else:
        y = fp8_gemm(x2, q, s, block[0], block[1], path=path, groups=groups)
    assert y.shape == (m, groups * rows) and y.dtype == torch.bfloat16
    per = rows // block[0] if rows % block[0] == 0 else None
    want = torch.cat([ref_gemm(x[:, i].float(), q[i * rows:(i + 1) * rows], s[i * per:(i + 1) * per], block)
                      if per else ref_gemm(x[:, i].float(), q, s, block)[:, i * rows:(i + 1) * rows]
                      for i in range(groups)], dim=1)
    assert rel_err(y, want) <= 5e-3, (path, shape, m)
    if path == "invariant" and per:
        by_group = torch.cat([fp8_invariant_gemm(x[:, i].contiguous(), q[i * rows:(i + 1) * rows],
                                                 s[i * per:(i + 1) * per], block[0], block[1])
                              for i in range(groups)], dim=1)
        assert torch.equal(y, by_group)
        assert torch.equal(fp8_invariant_gemm(x2[:1], q, s, block[0], block[1], groups=groups), y[:1])
