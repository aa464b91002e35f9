"""Fused mixture-of-experts with block-scaled FP8 expert weights (DeepSeek-V3/R1 release format) in Triton: the
W8A8 scheme of deepinfer_kernels.fp8_gemm inside the grouped GEMMs of deepinfer_kernels.fused_moe.

    gate_up (E, 2I, H) float8_e4m3fn, scale (E, 2 ceil(I/bn), ceil(H/bk)) float32: gate's row blocks, then up's
    down    (E, H, I)  float8_e4m3fn, scale (E, ceil(H/bn), ceil(I/bk)) float32

Rows are (token, slot) pairs sorted by expert as in fused_moe (moe_align, or one block per pair for a few
pairs). Each K step is one BLOCK_K = bk slice: the pair's activations are quantized there per row (amax / 448,
the releases' dynamic scheme: the token's bk-channel group), one fp8 tensor-core dot with the weight tile, then
scaled by the row's activation scale and each column's weight block scale, into an fp32 accumulator:

    acc[m, n] += dot(q(a)[m, k0:k0+bk], w[e, n, k0:k0+bk]) * s_a[m] * s_w[e, n / bn, k0 / bk]

gate_up writes h = silu(gate) * up in x's dtype; down quantizes h the same way, scales each pair's fp32 result
by its top-k weight, and the k slots of a token are summed in slot order (fused_moe.combine_slots). No split-K. The
torch form is deepinfer_kernels.reference.fused_moe_fp8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.fused_moe import combine_slots, pair_blocks, pair_rows

FP8_MAX = tl.constexpr(448.0)
MIN_AMAX = tl.constexpr(1e-12)


@triton.jit
def _quantize_rows(a):
    """a (M, BK) fp32 -> (values on e4m3's range, per-row scale amax / 448)."""
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), MIN_AMAX) / FP8_MAX
    return tl.clamp(a / scale[:, None], -FP8_MAX, FP8_MAX), scale


@triton.jit
def _dot_fp8(v, w, IS_INTERPRETED: tl.constexpr):
    """v (M, BK) fp32 on e4m3's range, w (BK, N) float8 -> the fp32 dot of e4m3(v) and w."""
    if IS_INTERPRETED:
        # As in fp8_gemm: the interpreter's fp32 -> e4m3 cast can drop a carry; round to the grid in fp32.
        ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)
        return tl.dot(tl.floor(v / ulp + 0.5) * ulp, w.to(tl.float32))
    return tl.dot(v.to(tl.float8e4nv), w)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_fp8(X, W, WS, H, SortedPairs, BlockExpert, NumPadded, num_pairs, top_k, N, K, up_row0,
                 stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                 GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PER_PAIR: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        g_ptrs = W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # (K, N) tiles
        u_ptrs = g_ptrs + N * stride_wn
        gs_ptrs = WS + e * stride_se + (offs_n // GROUP_N) * stride_sn
        us_ptrs = WS + e * stride_se + (up_row0 + offs_n // GROUP_N) * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kmask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            v, a_scale = _quantize_rows(a)
            g = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            g_scale = tl.load(gs_ptrs + kb, mask=nmask, other=0.0)
            u_scale = tl.load(us_ptrs + kb, mask=nmask, other=0.0)
            acc_g += _dot_fp8(v, g, IS_INTERPRETED) * a_scale[:, None] * g_scale[None, :]
            acc_u += _dot_fp8(v, u, IS_INTERPRETED) * a_scale[:, None] * u_scale[None, :]
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(H + pair.to(tl.int64)[:, None] * stride_hm + offs_n[None, :], h.to(H.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_fp8(A, W, WS, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, N, K,
              stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
              GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PER_PAIR: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + pair64[:, None] * stride_am + offs_k[None, :]
        w_ptrs = W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        ws_ptrs = WS + e * stride_se + (offs_n // GROUP_N) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kmask = offs_k < K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            v, a_scale = _quantize_rows(a)
            w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            w_scale = tl.load(ws_ptrs + kb, mask=nmask, other=0.0)
            acc += _dot_fp8(v, w, IS_INTERPRETED) * a_scale[:, None] * w_scale[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        acc *= tl.load(TopkWeights + pair64, mask=mmask, other=0.0)[:, None]
        tl.store(Y + pair64[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def _tiles(num_pairs: int) -> dict:
    """Fixed tiles (no autotuning yet: the H200 sweep is a GPU check to run): narrow N tiles when few pairs
    stream each expert's weights."""
    if num_pairs <= 64:
        return dict(BLOCK_N=32, num_warps=4, num_stages=4)
    return dict(BLOCK_N=64, num_warps=4, num_stages=3)


def fused_moe_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                  down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  block: tuple[int, int] = (128, 128), config: dict | None = None) -> torch.Tensor:
    """x (T, H) 16/32-bit; FP8 experts with their block scales (module docstring); weights (T, k) fp32; ids
    (T, k) -> sum_k weights * down(silu(gate x) * up x), (T, H) in x's dtype. block = (bn, bk) of the weight
    scales; bk (a power of two >= 16) is also the activations' quantization group. config: fixed BLOCK_N /
    num_warps / num_stages (tests)."""
    t, k = ids.shape
    e, two_i, hidden = gate_up.shape
    inter = two_i // 2
    bn, bk = block
    if gate_up.dtype != torch.float8_e4m3fn or down.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fused_moe_fp8 takes float8_e4m3fn experts, got {gate_up.dtype} / {down.dtype}")
    want_gu = (e, 2 * triton.cdiv(inter, bn), triton.cdiv(hidden, bk))
    want_down = (e, triton.cdiv(hidden, bn), triton.cdiv(inter, bk))
    if tuple(gate_up_scale.shape) != want_gu or tuple(down_scale.shape) != want_down:
        raise ValueError(f"expert scales {tuple(gate_up_scale.shape)} / {tuple(down_scale.shape)} != {want_gu} / "
                         f"{want_down}, the {bn}x{bk} blocks of gate_up {tuple(gate_up.shape)} / down "
                         f"{tuple(down.shape)}")
    if not all(a.is_contiguous() for a in (x, gate_up, down, gate_up_scale, down_scale)):
        raise ValueError("fused_moe_fp8 needs contiguous x, expert weights and scales")
    num_pairs = t * k
    blocks = pair_blocks(ids, e)
    config = dict(config or _tiles(num_pairs))
    common = dict(GROUP_N=bn, BLOCK_M=blocks.block_m, BLOCK_K=bk, PER_PAIR=blocks.per_pair,
                  IS_INTERPRETED=x.device.type == "cpu", **config)
    h = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)
    _gate_up_fp8[(blocks.num_blocks, triton.cdiv(inter, config["BLOCK_N"]))](
        x, gate_up, gate_up_scale, h, *blocks.tensors, num_pairs, k, inter, hidden,
        triton.cdiv(inter, bn), x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), h.stride(0), **common)
    _down_fp8[(blocks.num_blocks, triton.cdiv(hidden, config["BLOCK_N"]))](
        h, down, down_scale, y, weights.flatten().float().contiguous(), *blocks.tensors,
        num_pairs, hidden, inter, h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
        down_scale.stride(1), y.stride(0), **common)
    return combine_slots(y, t, k, hidden)
