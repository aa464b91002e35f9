"""Skinny GEMM in Triton: y = x @ w.T for a few rows of x (decode at small batch), reading w once at full width.
The engine uses it for large weights only (the LM head; see MIN_WEIGHT_ELEMENTS).

At M = 1..16 a decode step's dense projections are bound by reading the weight, yet cuBLAS runs them at about
half the copy bandwidth on an H200 (benchmark/README.md). Here each program owns BLOCK_N rows of w (BLOCK_N
output columns) and walks the whole K in BLOCK_K steps, the tiles pipelined `num_stages` deep; the few rows of
x ride along as a 16-row tile of the tensor-core dot (masked past M). No split-K: each output is one program's
fp32 sum in K order, so results do not depend on the launch and need no second pass. Enough programs for the
device come from small BLOCK_N (the autotuner picks it per shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
"""Rows of x this kernel takes (one tensor-core tile); more rows go to the library GEMM."""
MIN_WEIGHT_ELEMENTS = 1 << 25
"""Smallest weight the engine routes here. Graph-timed on an H200 (benchmark/bench_kernels.py --only dense), the
kernel beats cuBLAS only on the LM head (102400 x 2048: 96.7 / 98.2 / 102.7 us against 110.7 / 104.9 / 106.9 us
at 1 / 4 / 16 rows); on V2-Lite's 1-23 MB projections both are latency-bound at 5-8 us and cuBLAS is 0.5-2.8 us
faster."""


def _configs() -> list[triton.Config]:
    return [triton.Config(dict(BLOCK_N=bn, BLOCK_K=bk), num_warps=w, num_stages=st)
            for bn, bk, w, st in ((16, 256, 4, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 128, 4, 5),
                                  (64, 128, 4, 4), (16, 128, 2, 6))]


@triton.jit
def _skinny_gemm_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    x_ptrs = X + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


_tuned_kernel = triton.autotune(_configs(), key=["N", "K"], warmup=5, rep=20)(_skinny_gemm_kernel)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_gemm takes F.linear(x, weight) for this x (rows flattened) and weight."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 0 < x.numel() // x.shape[-1] <= MAX_ROWS and weight.dim() == 2 and weight.stride(1) == 1
            and x.shape[-1] % 16 == 0 and weight.numel() >= MIN_WEIGHT_ELEMENTS)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x (..., K) of at most MAX_ROWS rows, weight (N, K) with unit column
    stride, 16-bit floats; fp32 accumulation, one rounding at the store. config: fixed BLOCK_N / BLOCK_K /
    num_warps / num_stages instead of the autotuner's (which times on a GPU; the interpreter test fixes one)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], weight.shape[0]
    y = x.new_empty(m, n)
    kernel, config = (_tuned_kernel, {}) if config is None else (_skinny_gemm_kernel, config)
    kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, **config)
    return y.view(*x.shape[:-1], n)
