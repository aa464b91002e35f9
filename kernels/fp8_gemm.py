"""Block-scaled W8A8 FP8 GEMM in Triton (DeepSeek-V3/R1 weights on Hopper): y = x @ dequant(w).T.

w is float8 e4m3 (N, K) with a float32 scale per GROUP_N rows x BLOCK_K columns (`weight_scale_inv`: 128 x 128
blocks in the V3 release; GROUP_N = 1 when a merged layer's shards do not start on a block boundary and the
scales were expanded per row). The activations are quantized inside the kernel, per token and per BLOCK_K
channels (amax / 448, the releases' dynamic scheme), so x comes in its own 16/32-bit dtype and no quantized copy
of it is written. Each K step is one fp8 tensor-core dot of a BLOCK_K slice, exact products summed in fp32,
then scaled by the token's activation scale and the weight block's scale and added to the fp32 accumulator:

    acc[m, n] += dot(q(x)[m, k0:k0+BK], w[n, k0:k0+BK]) * s_x[m, k0 / BK] * s_w[n / GROUP_N, k0 / BK]

No split-K: each output is one program's sum in K order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)
"""As deepinfer_kernels.reference.quantize_fp8_blocks: a zero group gets a tiny scale, not 0 / 0."""


@triton.jit
def _fp8_block_gemm_kernel(X, W, WS, B, Y, M, N, K, stride_xm, stride_wn, stride_wsn, stride_ym,
                           HAS_BIAS: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    ws_ptrs = WS + (offs_n // GROUP_N) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - kb * BLOCK_K
        x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_AMAX)  # (BLOCK_M,)
        x_scale = amax / FP8_MAX
        v = tl.clamp(x / x_scale[:, None], -FP8_MAX, FP8_MAX)  # (x / x_scale can round past 448)
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        w_scale = tl.load(ws_ptrs + kb, mask=nmask, other=0.0)  # (BLOCK_N,)
        if IS_INTERPRETED:
            # Triton's interpreter drops the carry when an fp32 -> e4m3 cast rounds up to the next power of two
            # (127.96 -> 64): round to e4m3's grid in fp32 instead (3 mantissa bits; subnormals below 2^-6),
            # and dot exact fp32 copies.
            ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)
            part = tl.dot(tl.floor(v / ulp + 0.5) * ulp, tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(v.to(tl.float8e4nv), tl.trans(w))
        acc += part * x_scale[:, None] * w_scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _config(m: int) -> dict:
    """Tiles by row count, the fastest of a sweep on an H200 (BLOCK_M 16-128, BLOCK_N 16-128, 4/8 warps, 3-5
    stages) at V2-Lite's fused_qkv_a (3648 x 2048), dense down (2048 x 10944) and gate_up (21888 x 2048): narrow N
    tiles for decode-sized x (more programs streaming the weight), 64 x 128 from a few hundred rows. Still 1.2-2.5x
    the time of cuBLAS bf16 on the dequantized weight (13 / 20 / 118 us against 11 / 12 / 49 us at M = 1 / 64 /
    2048 on fused_qkv_a): the activations are quantized again by every N tile."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=5)
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3)


def fp8_block_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int,
                   block_k: int, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x (..., K) 16/32-bit, weight (N, K) float8_e4m3fn, weight_scale_inv (ceil(N/group_n), ceil(K/block_k))
    float32 -> (..., N) in x's dtype. block_k is the weights' column block and the activations' group (a power
    of two >= 16). config: fixed BLOCK_M / BLOCK_N / num_warps / num_stages (the interpreter test)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    assert weight.shape[1] == k and weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
    assert weight_scale_inv.shape == (triton.cdiv(n, group_n), triton.cdiv(k, block_k))
    y = x.new_empty(m, n)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    config = dict(config or _config(m))
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _fp8_block_gemm_kernel[grid](
        x2, weight, weight_scale_inv, bias if bias is not None else weight_scale_inv, y, m, n, k,
        x2.stride(0), weight.stride(0), weight_scale_inv.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        GROUP_N=group_n, BLOCK_K=block_k, IS_INTERPRETED=x.device.type == "cpu", **config)
    return y.view(*x.shape[:-1], n)
