"""Activations to e4m3 once per (token, group of GROUP channels), for the FP8 GEMMs that read them pre-quantized
(deepinfer_kernels.fp8_gemm's tiled Triton GEMM and torch's block-scaled scaled_mm).

The values are those the fused W8A8 kernel (fp8_gemm._fp8_block_gemm_kernel) and the GEMV's in-kernel form compute:
all three quantize through `quantize_groups` (amax floored at MIN_AMAX, scale = amax / 448, x / scale clamped to
+-448, cast to e4m3), so a GEMM over them sums the products those kernels sum.

Layout: q (M_pad, K) float8_e4m3fn row-major; scales float32 (M_pad, ceil(K / GROUP)) with strides (1, M_pad),
the M-major layout cuBLASLt's 1x128 block scaling reads (torch.nn.functional.scaled_mm, ScalingType.BlockWise1x128).
M_pad rounds M up to `row_multiple` (cuBLASLt wants a multiple of 4); the rows past M hold zeros and the scale of a
zero group, and a caller slices its output back to M rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)
"""As deepinfer_kernels.reference.quantize_fp8_blocks: a zero group gets a tiny scale, not 0 / 0."""


@triton.jit
def interpreted_e4m3(v):
    """v (within +-448) rounded to e4m3's grid in fp32, for the interpreter (its own cast can drop a carry): the
    magnitude rounded, then the sign (a tiny negative stays -0, as the cast gives); ties round away from zero where
    the GPU's cast rounds them to even (a value exactly halfway between two e4m3 neighbours). The cast of a value on
    the grid is exact."""
    ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)
    rounded = tl.floor(tl.abs(v) / ulp + 0.5) * ulp
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def quantize_groups(x):
    """x (R, GROUP) fp32 -> (v, scale): per row scale = max(amax, MIN_AMAX) / FP8_MAX and v = x / scale clamped to
    +-FP8_MAX (the division can round past 448), still fp32 for the caller to cast to e4m3 (the interpreter: to
    round with interpreted_e4m3). The one rule of every FP8 activation quantization here (this kernel, the fused
    GEMM's and the GEMV's in-kernel forms), so their products agree bit for bit."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX) / FP8_MAX
    return tl.clamp(x / scale[:, None], -FP8_MAX, FP8_MAX), scale


@triton.jit
def _quantize_token_groups_kernel(X, Q, S, M, M_PAD, K, stride_xm, stride_sg, BLOCK_M: tl.constexpr,
                                  GROUP: tl.constexpr, IS_INTERPRETED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = group * GROUP + tl.arange(0, GROUP)
    kmask = offs_k < K
    x = tl.load(X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m < M)[:, None] & kmask[None, :], other=0.0).to(tl.float32)
    v, x_scale = quantize_groups(x)
    if IS_INTERPRETED:
        v = interpreted_e4m3(v)
    # Rows from M to M_PAD are stored too (zeros), so a padded operand holds no garbage.
    rows = offs_m < M_PAD
    tl.store(Q + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :], v.to(tl.float8e4nv),
             mask=rows[:, None] & kmask[None, :])
    tl.store(S + group * stride_sg + offs_m, x_scale, mask=rows)


def quantize_fp8_token_groups(x: torch.Tensor, group: int = 128, row_multiple: int = 1, block_m: int = 16,
                              pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) 16/32-bit -> (q float8_e4m3fn (M_pad, K), scales float32 (M_pad, ceil(K / group)), M-major),
    M_pad = M rounded up to row_multiple. group: a power of two >= 16 (the weights' column block). pdl: a
    programmatic dependent launch (dispatch.pdl_launch)."""
    assert x.dim() == 2 and group >= 16 and group & (group - 1) == 0, (tuple(x.shape), group)
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    m_pad = triton.cdiv(max(m, 1), row_multiple) * row_multiple
    groups = triton.cdiv(k, group)
    q = torch.empty(m_pad, k, dtype=torch.float8_e4m3fn, device=x.device)
    # (groups, M_pad) row-major seen as (M_pad, groups): each group's scales contiguous over the tokens.
    scales = torch.empty(groups, m_pad, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m_pad, block_m), groups)
    _quantize_token_groups_kernel[grid](x, q, scales, m, m_pad, k, x.stride(0), scales.stride(0), BLOCK_M=block_m,
                                        GROUP=group, IS_INTERPRETED=x.device.type == "cpu", **pdl_launch(pdl))
    return q, scales.t()
