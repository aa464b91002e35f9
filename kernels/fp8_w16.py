"""FP8 block-scaled weights times 16-bit activations (W8A16): the weight tile is dequantized in registers.

DeepSeek-V4.1's dense weights carry an e8m0 scale per 32 x 32 block. The W8A8 kernels (fp8_gemm) multiply
e4m3 activations by e4m3 weights and rescale every product tile by the activation and weight scales of its
32-wide K block: four rescales of the whole accumulator per 128 inputs, which held the tiled kernel at 0.1-0.3 of
the FP8 floor at 64-256 rows (H100, results/gpu_fp8_gemm_ksub_v41_h100.json), slower than bf16 cuBLAS on the
dequantized weight. Here each program turns its weight tile into the activations' dtype (value x block scale:
exact for e8m0 scales, which are powers of two) and multiplies it by the activations as they are, so there is
no activation quantization and no rescale of the accumulator; the weight tile is the dot's first operand
(out^T = W x^T, transposed at the store), held in registers as Hopper's wgmma takes it.

    y = x @ (weight * expand(weight_scale_inv)).T  (+ bias)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.fp8_split import TILED_K_STEP, m_bucket


@triton.jit
def _fp8_w16_kernel(X, W, WS, B, Y, M, N, K, M_BUCKET, stride_xm, stride_wn, stride_wsn, stride_ym,
                    HAS_BIAS: tl.constexpr, GROUP_N: tl.constexpr, BLOCK_K: tl.constexpr, KSUB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WIDE: tl.constexpr = False,
                    IEEE: tl.constexpr = False):
    """acc[n, m] += dot(w[n, k0:k0+BK] * ws[n / GROUP_N, k0 / BK], x[m, k0:k0+BK].T); KSUB scale blocks a step,
    one dot each or (WIDE) one dot of the step's KSUB * BK inputs. M_BUCKET only keys the autotuner. IEEE (fp32
    activations): full fp32 products, not TF32."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if WIDE:
        offs_k = tl.arange(0, BLOCK_K * KSUB)
    else:
        offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    mmask = offs_m < M
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_m.to(tl.int64)[None, :] * stride_xm + offs_k[:, None]  # (BK, BM): x's rows as columns
    ws_ptrs = WS + (offs_n // GROUP_N) * stride_wsn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K * KSUB)):
        if WIDE:
            kmask = offs_k < K - step * BLOCK_K * KSUB
            w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            offs_b = tl.arange(0, KSUB)
            s = tl.load(ws_ptrs[:, None] + step * KSUB + offs_b[None, :],
                        mask=nmask[:, None] & (offs_b[None, :] < tl.cdiv(K, BLOCK_K) - step * KSUB), other=0.0)
            xt = tl.load(x_ptrs, mask=kmask[:, None] & mmask[None, :], other=0.0)
            wd = tl.reshape(tl.reshape(w.to(tl.float32), (BLOCK_N, KSUB, BLOCK_K)) * s[:, :, None],
                            (BLOCK_N, KSUB * BLOCK_K))
            if IEEE:
                acc = tl.dot(wd.to(xt.dtype), xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(wd.to(xt.dtype), xt, acc)
        else:
            for j in tl.static_range(KSUB):
                kb = step * KSUB + j
                kmask = offs_k < K - kb * BLOCK_K  # all false past K: zero values, no scale read there
                w = tl.load(w_ptrs + j * BLOCK_K, mask=nmask[:, None] & kmask[None, :], other=0.0)
                s = tl.load(ws_ptrs + kb, mask=nmask & (offs_n * 0 + kb * BLOCK_K < K), other=0.0)
                xt = tl.load(x_ptrs + j * BLOCK_K, mask=kmask[:, None] & mmask[None, :], other=0.0)
                wd = (w.to(tl.float32) * s[:, None]).to(xt.dtype)
                if IEEE:
                    acc = tl.dot(wd, xt, acc, input_precision="ieee")
                else:
                    acc = tl.dot(wd, xt, acc)
        w_ptrs += BLOCK_K * KSUB
        x_ptrs += BLOCK_K * KSUB
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None], acc.to(Y.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


W16_CONFIGS = [
    triton.Config(dict(BLOCK_N=bn, BLOCK_M=bm, WIDE=wide), num_warps=w, num_stages=s)
    for bn, bm, w, s, wide in ((64, 16, 4, 4, False), (64, 32, 4, 4, False), (128, 16, 4, 4, False),
                               (128, 32, 4, 4, False), (128, 64, 4, 3, False), (128, 64, 8, 3, False),
                               (128, 128, 8, 3, False), (64, 64, 4, 4, False),
                               (64, 16, 4, 4, True), (64, 32, 4, 4, True), (128, 16, 4, 4, True),
                               (128, 32, 4, 4, True), (64, 64, 4, 4, True),
                               (64, 128, 4, 3, False), (128, 256, 8, 2, False), (64, 128, 4, 3, True),
                               (128, 64, 8, 3, True), (128, 128, 8, 3, True))
]
"""Tiles the autotuner tries on the GPU, keyed by (M bucket, N, K): BLOCK_N rows of weight (the dot's M side,
64 a warpgroup) times BLOCK_M activation rows, one dot a scale block or (WIDE) a step. Every one compiles for sm90
with no local-memory spill and within a block's shared memory (Triton 3.6 with the JIT's 16-byte alignment,
scripts/sass_report.py; 128 x 256 takes two stages: three need 233,472 bytes); the last five, for 128-256 rows,
were added from that check and are not yet timed."""
INTERPRETER_TILE = dict(BLOCK_N=32, BLOCK_M=16)
"""The interpreter's tile (WIDE is a config key: tests pass it both ways)."""

_w16_tuned = triton.autotune(W16_CONFIGS, key=["M_BUCKET", "N", "K", "BLOCK_K", "KSUB"])(_fp8_w16_kernel)


def fp8_w16_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, group_n: int,
                 block_k: int, bias: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x (..., K) 16/32-bit times weight (N, K) float8_e4m3fn with float32 block scales (ceil(N / group_n),
    ceil(K / block_k)) -> (..., N) in x's dtype (fp32 x: fp32 products, as the torch form; 16-bit x: one rounding of
    each dequantized weight, exact for e8m0 scales). config: fixed BLOCK_N / BLOCK_M / num_warps / num_stages instead
    of the autotuner (the interpreter runs INTERPRETER_TILE)."""
    k, n = x.shape[-1], weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"fp8_w16_gemm: weight {tuple(weight.shape)} {weight.dtype} for inputs of {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*x.shape[:-1], n)
    args = (x2, weight, weight_scale_inv, bias if bias is not None else weight_scale_inv, y, m, n, k, m_bucket(m),
            x2.stride(0), weight.stride(0), weight_scale_inv.stride(0), y.stride(0))
    flags = dict(HAS_BIAS=bias is not None, GROUP_N=group_n, BLOCK_K=block_k, KSUB=max(1, TILED_K_STEP // block_k),
                 IEEE=x.dtype == torch.float32)
    if config is None and x.device.type == "cpu":
        config = INTERPRETER_TILE
    if config is not None:
        grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(m, config["BLOCK_M"]))
        _fp8_w16_kernel[grid](*args, **flags, **config)
    else:
        _w16_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]))](*args, **flags)
    return y.view(*x.shape[:-1], n)
