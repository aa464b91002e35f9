"""FP8 block-scaled weights dequantized into a scratch tensor, then the 16-bit GEMM of the build (cuBLAS on CUDA).

V4.1's dense weights carry an e8m0 scale per 32 x 32 block. At a few hundred rows the in-register W8A16 kernel
(fp8_w16) is compute-bound below the tensor cores' rate: on an H100 at V4.1-Flash's projections and 256 rows it took
2.0-3.4x the time of bf16 cuBLAS on the dequantized weight (results/gpu_fp8_gemm_w16_h100.json). Here one launch
writes value x block scale for the whole weight in the activations' dtype (exact: e8m0 scales are powers of two
and bf16 holds fp32's exponent range) into a scratch tensor the caching allocator hands back after the product,
and torch's GEMM multiplies it by the activations as they are: the same numbers as fp8_w16, summed in cuBLAS's
order. In bf16 it moves five bytes a weight (one read, two written, two read again): four more than the FP8 read,
three more than cuBLAS on a weight dequantized once. That pays only where the GEMM is compute-bound: prefill chunks,
and decode batches in the hundreds.

    y = x @ (weight * expand(weight_scale_inv)).T  (+ bias)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

DEQUANT_TILE = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4)
"""Each program converts BLOCK_N weight rows x BLOCK_K columns (8 KB of e4m3, 16 KB written in bf16; BLOCK_K grows
to the scale block where that is wider)."""


@triton.jit
def _dequant_kernel(W, WS, Out, N, K, stride_wn, stride_wsn, stride_on, GROUP_N: tl.constexpr,
                    GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Out[n, k] = W[n, k] * WS[n / GROUP_N, k / GROUP_K], rounded once to Out's dtype. BLOCK_K is a multiple of
    GROUP_K: a row's BLOCK_K / GROUP_K scales are loaded once and broadcast over their columns."""
    S: tl.constexpr = BLOCK_K // GROUP_K
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_s = tl.program_id(1) * S + tl.arange(0, S)
    nmask = offs_n < N
    mask = nmask[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    w = tl.load(W + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(WS + (offs_n // GROUP_N).to(tl.int64)[:, None] * stride_wsn + offs_s[None, :],
                mask=nmask[:, None] & (offs_s * GROUP_K < K)[None, :], other=0.0)
    out = (w.reshape(BLOCK_N, S, GROUP_K) * s[:, :, None]).reshape(BLOCK_N, BLOCK_K)
    tl.store(Out + rows * stride_on + offs_k[None, :], out.to(Out.dtype.element_ty), mask=mask)


def dequantize_fp8_weight(weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int, block_k: int,
                          dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight (N, K) e4m3 with scales (ceil(N / group_n), ceil(K / block_k)) fp32 -> (N, K) in `dtype` (or into
    `out`, contiguous (N, K) of that dtype), in one launch."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 dequantize: a float8_e4m3fn weight is taken, got {weight.dtype}")
    if block_k & (block_k - 1):
        raise ValueError(f"fp8 dequantize: scale blocks of {block_k} columns (a power of two is taken)")
    if weight_scale_inv.shape != (triton.cdiv(n, group_n), triton.cdiv(k, block_k)):
        raise ValueError(f"fp8 dequantize: scales {tuple(weight_scale_inv.shape)} for a {n} x {k} weight of "
                         f"{group_n} x {block_k} blocks")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    scale = weight_scale_inv.float().contiguous()
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=weight.device)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"fp8 dequantize: out {tuple(out.shape)} {out.dtype} for a {n} x {k} {dtype} weight")
    tile = DEQUANT_TILE
    block_kc = max(tile["BLOCK_K"], block_k)  # whole scale blocks a tile
    if n and k:
        grid = (triton.cdiv(n, tile["BLOCK_N"]), triton.cdiv(k, block_kc))
        _dequant_kernel[grid](weight, scale, out, n, k, weight.stride(0), scale.stride(0), out.stride(0),
                              GROUP_N=group_n, GROUP_K=block_k, BLOCK_N=tile["BLOCK_N"], BLOCK_K=block_kc,
                              num_warps=tile["num_warps"])
    return out


def fp8_dequant_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int,
                     block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(weight).T (+ bias) in x's dtype: the weight dequantized into scratch, then F.linear."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8 dequant GEMM: x {tuple(x.shape)} for a weight of {weight.shape[1]} inputs")
    dense = dequantize_fp8_weight(weight, weight_scale_inv, group_n, block_k, x.dtype)
    return F.linear(x, dense, None if bias is None else bias.to(x.dtype))
