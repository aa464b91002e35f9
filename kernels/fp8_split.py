"""Pieces the block-scaled FP8 GEMM paths share (deepinfer_kernels.fp8_gemm, fp8_gemv, fp8_w16): the sum of K-split
fp32 partials in split order, a grouped (block-diagonal) GEMM's shape checks, the autotuners' row key and the inputs
a step of the tiled kernels."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_wait

TILED_K_STEP = 128
"""Inputs of each weight row the tiled kernels (fp8_gemm's tiled GEMM, fp8_w16) read a step: blocks narrower than
this (V4.1's 32) take several a step."""


def m_bucket(m: int) -> int:
    """The autotuners' key for a row count: powers of four from 16 to 4096, then 8192 for every larger M."""
    bucket = 16
    while bucket < m and bucket < 8192:
        bucket *= 4 if bucket < 4096 else 2
    return bucket


@triton.jit
def _split_k_sum_kernel(P, B, Y, M, N, stride_ym, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y[m, n] = p[0, m, n] + p[1, m, n] + ... (+ bias): fp32 adds in split order, one rounding at the store."""
    pdl_wait(PDL)
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.load(P + m * N + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


def group_tile_n(block_n: int, rows: int) -> int:
    """The widest N tile up to block_n that divides a group's `rows`, so that no tile straddles two groups."""
    tile = min(block_n, rows & -rows)
    if tile < 16:
        raise ValueError(f"a grouped FP8 GEMM needs a multiple of 16 output rows a group, not {rows}")
    return tile


def _group_rows(x: torch.Tensor, weight: torch.Tensor, groups: int) -> int:
    """Output rows a group of a grouped GEMM (0 for a plain one), its shapes checked."""
    k, n = weight.shape[1], weight.shape[0]
    if x.shape[-1] != groups * k or n % groups:
        raise ValueError(f"grouped FP8 GEMM: x's {x.shape[-1]} columns and weight {tuple(weight.shape)} do not "
                         f"make {groups} groups")
    return n // groups if groups > 1 else 0
