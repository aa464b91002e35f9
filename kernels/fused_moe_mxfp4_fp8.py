"""The fused MXFP4 MoE on FP8 tensor cores (decode "fp8" of deepinfer_kernels.fused_moe_mxfp4): Hopper has no FP4
MMA, and its 16-bit forms spend more time turning each e2m1 code into a scaled bf16 value than reading it.

An e2m1 code c (sign bit 3, exponent bits 2-1, mantissa bit 0) placed as e4m3 bits, sign -> 7, exponent -> 4-3,
mantissa -> 2, reads exactly its value x 2^-6 (code 1, 0.5, is e4m3's subnormal 2^-7). Both nibbles of four packed
bytes become four e4m3 bytes in about five 32-bit integer instructions (`_e4m3_codes`, inline PTX; the same
integer arithmetic per byte in Triton's interpreter). The group's e8m0 scale 2^(b - 127) and the 2^6 then multiply
the fp32 product of that 32-element group, so each K tile is one K=32 FP8 dot per scale group:

    acc[m, n] += dot(xq[m, group g], w[group g, n]) * xs[m, g] * 2^(b[n, g] - 121)

The activations are e4m3 with one fp32 scale per (row, 32 elements) (deepinfer_kernels.fp8_quant, group 32: the
MXFP8 form of the releases' own FP8 x FP4 expert GEMMs): x before gate_up, h before down. So this form rounds the
activations, which the 16-bit forms do not; its error against the dequantize-then-matmul reference is that of an
e4m3 activation (tests bound it). gate_up writes the clamped SwiGLU h in the model dtype; down scales each pair by
its top-k weight; fused_moe.combine_slots sums a token's slots.
"""
from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_kernels.fused_moe import pair_tile, store_swiglu, store_weighted

_LOW = tl.constexpr("{.reg .b32 t0, t1; and.b32 t0, $1, 0x07070707; shl.b32 t0, t0, 2; "
                    "and.b32 t1, $1, 0x08080808; shl.b32 t1, t1, 4; or.b32 $0, t0, t1;}")
_HIGH = tl.constexpr("{.reg .b32 t0, t1; shr.b32 t0, $1, 2; and.b32 t0, t0, 0x1C1C1C1C; "
                     "and.b32 t1, $1, 0x80808080; or.b32 $0, t0, t1;}")


@triton.jit
def _e4m3_codes(b, HIGH: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """int8 bytes -> the e4m3 bits (int8) of their low (HIGH False) or high nibble's e2m1 code: value x 2^-6. Four
    bytes per 32-bit register through PTX on CUDA; the same arithmetic per byte in Triton's interpreter."""
    if not IS_INTERPRETED:
        return tl.inline_asm_elementwise(_HIGH if HIGH else _LOW, "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    v = b.to(tl.int32) & 0xFF
    if HIGH:
        v = v >> 4
    return (((v & 7) << 2) | ((v & 8) << 4)).to(tl.uint8).to(tl.int8, bitcast=True)


@triton.jit
def _mx_fp8_acc(a_ptrs, as_ptrs, stride_asg, mmask, w_ptrs, s_ptrs, nmask, acc, k0, K, BLOCK_N: tl.constexpr,
                G: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) += the K tile [k0, k0 + 32 G): a_ptrs (BLOCK_M, 32) e4m3 activations at column 0,
    as_ptrs (BLOCK_M,) their scales at group 0 (groups stride_asg apart), w_ptrs (16, BLOCK_N) packed bytes at byte
    0, s_ptrs (BLOCK_N,) e8m0 scale bytes at group 0. K is a multiple of 32: a group is all in or all out."""
    for g in tl.static_range(G):
        kk = k0 + 32 * g
        b = tl.load(w_ptrs + kk // 2, mask=((kk + 2 * tl.arange(0, 16)) < K)[:, None] & nmask[None, :], other=0)
        lo = _e4m3_codes(b, False, IS_INTERPRETED)
        hi = _e4m3_codes(b, True, IS_INTERPRETED)
        # (16, N) low and high codes -> (32, N) in element order (2j low, 2j + 1 high)
        w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (32, BLOCK_N)).to(tl.float8e4nv, bitcast=True)
        a = tl.load(a_ptrs + kk, mask=mmask[:, None] & ((kk + tl.arange(0, 32)) < K)[None, :], other=0.0)
        if IS_INTERPRETED:  # the interpreter dots exact fp32 copies of the e4m3 values
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w)
        gi = tl.minimum(kk // 32, K // 32 - 1)  # a group past K has a zero product: any valid scale will do
        xs = tl.load(as_ptrs + gi * stride_asg, mask=mmask, other=0.0)
        s = tl.load(s_ptrs + gi, mask=nmask, other=0).to(tl.int32) & 0xFF
        ws = ((tl.minimum(s, 248) + 6) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) x 2^6
        acc += part * xs[:, None] * ws[None, :]
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_mxfp4_fp8(XQ, XS, W, WS, H, SortedPairs, BlockExpert, NumPadded, num_pairs, top_k, N, K, limit,
                       stride_xm, stride_xsg, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PER_PAIR: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """h[pair] = clamped SwiGLU(x W_gate^T, x W_up^T) for one (row block, N tile); x as e4m3 XQ (rows, K) with
    scales XS (rows, K / 32) (strides stride_xm / 1 and 1 / stride_xsg: fp8_quant's M-major scales)."""
    pair, e, valid, mmask, offs_n, nmask = pair_tile(SortedPairs, BlockExpert, NumPadded, num_pairs, N, BLOCK_M,
                                                     BLOCK_N, PER_PAIR)
    if valid:
        G: tl.constexpr = BLOCK_K // 32
        tok = (pair // top_k).to(tl.int64)
        rows = offs_n.to(tl.int64)
        a_ptrs = XQ + tok[:, None] * stride_xm + tl.arange(0, 32)[None, :]
        as_ptrs = XS + tok
        g_ptrs = W + e * stride_we + rows[None, :] * stride_wn + tl.arange(0, 16)[:, None]  # (16, N) of W_gate^T
        u_ptrs = g_ptrs + N * stride_wn
        gs_ptrs = WS + e * stride_se + rows * stride_sn
        us_ptrs = gs_ptrs + N * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_g = _mx_fp8_acc(a_ptrs, as_ptrs, stride_xsg, mmask, g_ptrs, gs_ptrs, nmask, acc_g, k0, K, BLOCK_N, G,
                                IS_INTERPRETED)
            acc_u = _mx_fp8_acc(a_ptrs, as_ptrs, stride_xsg, mmask, u_ptrs, us_ptrs, nmask, acc_u, k0, K, BLOCK_N, G,
                                IS_INTERPRETED)
        store_swiglu(H, pair, offs_n, mmask, nmask, acc_g, acc_u, limit, stride_hm)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_mxfp4_fp8(AQ, AS, W, WS, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, N, K,
                    stride_am, stride_asg, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAIR: tl.constexpr,
                    IS_INTERPRETED: tl.constexpr):
    """y[pair] = top-k weight x h W_down^T for one (row block, N tile); h as e4m3 AQ (pairs, K) with scales AS."""
    pair, e, valid, mmask, offs_n, nmask = pair_tile(SortedPairs, BlockExpert, NumPadded, num_pairs, N, BLOCK_M,
                                                     BLOCK_N, PER_PAIR)
    if valid:
        G: tl.constexpr = BLOCK_K // 32
        pair64 = pair.to(tl.int64)
        rows = offs_n.to(tl.int64)
        a_ptrs = AQ + pair64[:, None] * stride_am + tl.arange(0, 32)[None, :]
        as_ptrs = AS + pair64
        w_ptrs = W + e * stride_we + rows[None, :] * stride_wn + tl.arange(0, 16)[:, None]
        s_ptrs = WS + e * stride_se + rows * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _mx_fp8_acc(a_ptrs, as_ptrs, stride_asg, mmask, w_ptrs, s_ptrs, nmask, acc, k0, K, BLOCK_N, G,
                              IS_INTERPRETED)
        store_weighted(Y, TopkWeights, pair64, offs_n, mmask, nmask, acc, stride_ym)
