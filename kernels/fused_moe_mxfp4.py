"""Fused mixture-of-experts over MXFP4 expert weights (DeepSeek-V4 / V4-Flash / V4.1 releases) in Triton, for
Hopper, which has no FP4 tensor cores: the e2m1 codes are unpacked and scaled by their e8m0 exponent inside the
grouped GEMMs, into operands of the activations' dtype (bf16 on the GPU), and multiplied on the 16-bit tensor
cores with fp32 accumulation. The weights stay 4-bit in memory (0.53 bytes per element with the scales), which is
what a memory-bound decode step reads.

    gate_up        int8 (E, 2I, H/2)  two e2m1 codes per byte, element 2j in the low nibble; gate's rows, then up's
    gate_up_scale  uint8 / float8_e8m0fnu (E, 2I, H/32)  one power of two 2^(b - 127) per 32 elements along K
    down           int8 (E, H, I/2),  down_scale (E, H, I/32)

e2m1 code c (sign bit 3, exponent bits 2-1, mantissa bit 0): magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6. Every
dequantized weight (value x 2^e) is exact in bf16, so the products equal those of a dequantize-then-matmul in the
same dtype; only the fp32 summation order differs.

A K step of BLOCK_K elements reads BLOCK_K / 2 bytes per weight row. Rather than interleaving the two nibbles back
into element order, the activations are read as their even and odd columns, and the tile is two dots:

    acc[m, n] += dot(x[m, k0 + 2j], lo(w[n, k0/2 + j]) s) + dot(x[m, k0 + 2j + 1], hi(w[n, k0/2 + j]) s)

with s = 2^(b - 127) of the scale column (k0 + 2j) / 32 (one per 16 bytes). The hand ("group") decode,
_mx_group_tile (fp32 activations, and a benchmark candidate), views a K tile as (BLOCK_K / 32 groups, 16 bytes, BLOCK_N): 16-byte loads, one scale byte per
group broadcast over its 16 bytes, and each code turned into its value by integer bit placement into fp16 and one
fp32 multiply (no exp2 per element); JOIN interleaves the even and odd operands back into element order for one
dot. The "scaled" form hands the packed bytes and scale bytes to tl.dot_scaled, whose upcast Triton writes itself
(the default above 8 pairs, measured faster). gate_up writes h = clamped SwiGLU
(V4's: silu(min(gate, limit)) * clamp(up, -limit, limit)) in x's dtype; down scales each (token, slot) pair's fp32
result by its top-k weight, and a token's k slots are summed in slot order (fused_moe.combine_slots). The torch form
(and the CPU path) is the dequantize-at-load one: layers/mxfp4.py Mxfp4DequantExperts.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from deepinfer_kernels.fused_moe import combine_slots, pair_blocks, pair_rows, store_swiglu, store_weighted
from deepinfer_kernels.fused_moe_mxfp4_gemv import gemv_experts

MX_BLOCK = 32


@triton.jit
def _dot2(a_even, a_odd, w_even, w_odd, acc, IEEE: tl.constexpr):
    if IEEE:  # fp32 activations: full fp32 products (TF32 would drift from the CPU reference)
        acc = tl.dot(a_even, w_even, acc, input_precision="ieee")
        return tl.dot(a_odd, w_odd, acc, input_precision="ieee")
    acc = tl.dot(a_even, w_even, acc)
    return tl.dot(a_odd, w_odd, acc)


@triton.jit
def _dot1(a, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _mx_group_tile(w_ptrs, s_ptrs, gmask, nmask, DTYPE: tl.constexpr):
    """The group-tiled decode: w_ptrs a (G, 16, BLOCK_N) tile of packed bytes (one e8m0 group of 32 elements per
    16 contiguous bytes), s_ptrs the (G, BLOCK_N) tile of their scale bytes -> the even and the odd elements'
    weights in DTYPE, (G, 16, BLOCK_N) each. No exp2 per element: a code's sign and 3 magnitude bits are placed
    as fp16 bits (sign -> 15, exponent -> 11..10, mantissa -> 9), which reads the code's value x 2^-14 (code 1,
    0.5, is the subnormal 2^-15); widened to fp32 (exact) and multiplied by the group's 2^(b - 113), built from
    its bits. Exact for e8m0 exponents b <= 240 (2^113); larger ones read as inf."""
    mask = gmask[:, None, None] & nmask[None, None, :]
    b = tl.load(w_ptrs, mask=mask, other=0).to(tl.int16)  # sign-extended: bit 7 stays bit 7
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    s = tl.load(s_ptrs, mask=gmask[:, None] & nmask[None, :], other=127).to(tl.int32) & 0xFF
    scale = ((tl.minimum(s, 241) + 14) << 23).to(tl.float32, bitcast=True)[:, None, :]
    w_lo = (lo.to(tl.float16, bitcast=True).to(tl.float32) * scale).to(DTYPE)
    w_hi = (hi.to(tl.float16, bitcast=True).to(tl.float32) * scale).to(DTYPE)
    return w_lo, w_hi


@triton.jit
def _mx_acc(a_ptrs, amask, w_ptrs, s_ptrs, gmask, nmask, acc, DTYPE: tl.constexpr, G: tl.constexpr,
            BLOCK_N: tl.constexpr, JOIN: tl.constexpr, IEEE: tl.constexpr):
    """acc += the activations' K tile (a_ptrs: (BLOCK_M, 32 G) in element order) x one weight K tile. JOIN: one
    (32 G, BLOCK_N) operand in element order (the nibbles interleaved back), one dot; else the (16 G, BLOCK_N) even
    and odd operands of the two-dot form. (Each branch returns only acc: Triton needs one return type.)"""
    w_lo, w_hi = _mx_group_tile(w_ptrs, s_ptrs, gmask, nmask, DTYPE)
    if JOIN:
        w = tl.reshape(tl.permute(tl.join(w_lo, w_hi), (0, 1, 3, 2)), (G * 32, BLOCK_N))  # element 2j, then 2j + 1
        acc = _dot1(tl.load(a_ptrs, mask=amask, other=0.0), w, acc, IEEE)
    else:
        a = tl.reshape(tl.load(a_ptrs, mask=amask, other=0.0), (a_ptrs.shape[0], G * 16, 2))
        a_even, a_odd = tl.split(a)
        acc = _dot2(a_even, a_odd, tl.reshape(w_lo, (G * 16, BLOCK_N)), tl.reshape(w_hi, (G * 16, BLOCK_N)), acc,
                    IEEE)
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_mxfp4_g(X, W, WS, H, SortedPairs, BlockExpert, NumPadded, num_pairs, top_k, N, K, limit,
                     stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAIR: tl.constexpr,
                     IEEE: tl.constexpr, JOIN: tl.constexpr):
    """h[pair] = clamped SwiGLU(x W_gate^T, x W_up^T) for one (row block, N tile), weights decoded by
    _mx_group_tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        G: tl.constexpr = BLOCK_K // 32
        mmask = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_g = tl.arange(0, G)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        rows = offs_n.to(tl.int64)
        byte = (offs_g[:, None] * 16 + tl.arange(0, 16)[None, :])[:, :, None]
        g_ptrs = W + e * stride_we + rows[None, None, :] * stride_wn + byte  # (G, 16, N) view of W_gate^T
        u_ptrs = g_ptrs + N * stride_wn
        gs_ptrs = WS + e * stride_se + rows[None, :] * stride_sn + offs_g[:, None]
        us_ptrs = gs_ptrs + N * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        dtype = X.dtype.element_ty
        for k0 in range(0, K, BLOCK_K):
            gmask = offs_g < (K - k0) // 32
            amask = mmask[:, None] & (offs_k < K - k0)[None, :]
            acc_g = _mx_acc(a_ptrs, amask, g_ptrs, gs_ptrs, gmask, nmask, acc_g, dtype, G, BLOCK_N, JOIN, IEEE)
            acc_u = _mx_acc(a_ptrs, amask, u_ptrs, us_ptrs, gmask, nmask, acc_u, dtype, G, BLOCK_N, JOIN, IEEE)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K // 2
            u_ptrs += BLOCK_K // 2
            gs_ptrs += G
            us_ptrs += G
        store_swiglu(H, pair, offs_n, mmask, nmask, acc_g, acc_u, limit, stride_hm)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_mxfp4_g(A, W, WS, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, N, K,
                  stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAIR: tl.constexpr,
                  IEEE: tl.constexpr, JOIN: tl.constexpr):
    """y[pair] = top-k weight x h W_down^T for one (row block, N tile), weights decoded by _mx_group_tile."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        G: tl.constexpr = BLOCK_K // 32
        mmask = pair < num_pairs
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_g = tl.arange(0, G)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = A + pair64[:, None] * stride_am + offs_k[None, :]
        rows = offs_n.to(tl.int64)
        byte = (offs_g[:, None] * 16 + tl.arange(0, 16)[None, :])[:, :, None]
        w_ptrs = W + e * stride_we + rows[None, None, :] * stride_wn + byte
        s_ptrs = WS + e * stride_se + rows[None, :] * stride_sn + offs_g[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        dtype = A.dtype.element_ty
        for k0 in range(0, K, BLOCK_K):
            gmask = offs_g < (K - k0) // 32
            amask = mmask[:, None] & (offs_k < K - k0)[None, :]
            acc = _mx_acc(a_ptrs, amask, w_ptrs, s_ptrs, gmask, nmask, acc, dtype, G, BLOCK_N, JOIN, IEEE)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2
            s_ptrs += G
        store_weighted(Y, TopkWeights, pair64, offs_n, mmask, nmask, acc, stride_ym)


@triton.jit
def _mx_scaled_acc(a, w_ptrs, s_ptrs, jmask, gmask, nmask, acc, FMT: tl.constexpr):
    """acc += a (BLOCK_M, BLOCK_K, element order) x the weight K tile through tl.dot_scaled: w_ptrs a
    (BLOCK_K / 2, BLOCK_N) tile of packed bytes (element 2j low), s_ptrs the (BLOCK_N, BLOCK_K / 32) e8m0 bytes.
    Triton's own upcast to a's format (Hopper has no FP4 MMA) replaces the hand decode."""
    w = tl.load(w_ptrs, mask=jmask[:, None] & nmask[None, :], other=0).to(tl.uint8, bitcast=True)
    s = tl.load(s_ptrs, mask=nmask[:, None] & gmask[None, :], other=127)
    return tl.dot_scaled(a, None, FMT, w, s, "e2m1", acc, fast_math=True)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_mxfp4_s(X, W, WS, H, SortedPairs, BlockExpert, NumPadded, num_pairs, top_k, N, K, limit,
                     stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAIR: tl.constexpr,
                     FMT: tl.constexpr):
    """_gate_up_mxfp4_g's product through tl.dot_scaled (_mx_scaled_acc); 16-bit activations."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        a_ptrs = X + tok[:, None] * stride_xm + offs_k[None, :]
        rows = offs_n.to(tl.int64)
        g_ptrs = W + e * stride_we + rows[None, :] * stride_wn + offs_j[:, None]  # (K/2, N) view of W_gate^T
        u_ptrs = g_ptrs + N * stride_wn
        gs_ptrs = WS + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]  # (N, K/32)
        us_ptrs = gs_ptrs + N * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=mmask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            jmask = offs_j < (K - k0) // 2
            gmask = offs_g < (K - k0) // 32
            acc_g = _mx_scaled_acc(a, g_ptrs, gs_ptrs, jmask, gmask, nmask, acc_g, FMT)
            acc_u = _mx_scaled_acc(a, u_ptrs, us_ptrs, jmask, gmask, nmask, acc_u, FMT)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K // 2
            u_ptrs += BLOCK_K // 2
            gs_ptrs += BLOCK_K // 32
            us_ptrs += BLOCK_K // 32
        store_swiglu(H, pair, offs_n, mmask, nmask, acc_g, acc_u, limit, stride_hm)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_mxfp4_s(A, W, WS, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, N, K,
                  stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PER_PAIR: tl.constexpr,
                  FMT: tl.constexpr):
    """_down_mxfp4_g's product through tl.dot_scaled (_mx_scaled_acc); 16-bit activations."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // 32)
        a_ptrs = A + pair64[:, None] * stride_am + offs_k[None, :]
        rows = offs_n.to(tl.int64)
        w_ptrs = W + e * stride_we + rows[None, :] * stride_wn + offs_j[:, None]
        s_ptrs = WS + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=mmask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
            acc = _mx_scaled_acc(a, w_ptrs, s_ptrs, offs_j < (K - k0) // 2, offs_g < (K - k0) // 32, nmask, acc,
                                 FMT)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
        store_weighted(Y, TopkWeights, pair64, offs_n, mmask, nmask, acc, stride_ym)


# (most pairs, tiles) rows for 16-bit activations, first match wins: the fastest per batch in runs of
# benchmark/bench_kernels.py --only mxfp4 (V4-Flash experts, top-8). One token: the GEMV form, 88 us against 92 for
# dot_scaled at 64 x 128 (H100, results/gpu_mxfp4_moe_h100_small.json). Above, tl.dot_scaled (Triton's own
# e2m1 x e8m0 upcast) at 64 x 128: 917 / 1,988 / 2,920 us at 16 / 64 / 256 tokens (H100) against 1,144 for the GEMV
# form at 16 tokens and 2,595 / 3,635 for the hand group decode at 64 / 256 (64 x 128, 5 stages), and 3,631 /
# 4,209 for the bf16 fused MoE on the same weights; 0.49 / 0.50 / 0.38 of the read bandwidth. At 2,048 tokens it
# is within 2.3% of the fastest candidate (n128 x k256, 8 warps); the table was set on an H100 (an H200's
# earlier sweep, before dot_scaled, had the GEMV form ahead at 16 tokens).
TILE_TABLE = (
    (8, dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3, decode="gemv")),
    (None, dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, decode="scaled")),
)
GROUP_TILES = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5, decode="group", JOIN=False)
"""The table's "scaled" row where this Triton lacks tl.dot_scaled's fast_math (Triton < 3.3): the hand group decode,
the previous default (2,595 / 3,635 us at 64 / 256 tokens in the run above)."""
HAS_DOT_SCALED = "fast_math" in inspect.signature(tl.dot_scaled).parameters if hasattr(tl, "dot_scaled") else False
# fp32 (CUDA cores, and the interpreter): narrow K tiles for the registers.
FP32_TILES = dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, decode="group", JOIN=False)
# Configurations a benchmark compares with the table's (the H200 sweep), by name.
MXFP4_CANDIDATES = {
    "group_n32_k128": dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, decode="group", JOIN=False),
    "group_n64_k256": dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, decode="group", JOIN=False),
    "group_n64_k256_join": dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, decode="group", JOIN=True),
    "group_n128_k128_w8": dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, decode="group", JOIN=False),
    "group_n128_k256_w8": dict(BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=2, decode="group", JOIN=False),
    "group_n64_k128_w4_s5": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5, decode="group", JOIN=False),
    "scaled_n32_k128": dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4, decode="scaled"),
    "scaled_n64_k128": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, decode="scaled"),
    "scaled_n64_k256": dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, decode="scaled"),
    "scaled_n128_k128_w8": dict(BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, decode="scaled"),
    "scaled_n128_k256_w8": dict(BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=3, decode="scaled"),
    "gemv_n32_k256": dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3, decode="gemv"),
    "gemv_n16_k512": dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3, decode="gemv"),
    "gemv_n64_k128": dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, decode="gemv"),
    "gemv_n32_k512_w8": dict(BLOCK_N=32, BLOCK_K=512, num_warps=8, num_stages=2, decode="gemv"),
}


DECODES = ("group", "scaled", "gemv")
"""fused_moe_mxfp4's forms of the e2m1 decode (its docstring)."""


def _tiles(num_pairs: int, dtype: torch.dtype) -> dict:
    """The tiles for a launch: FP32_TILES for fp32, else TILE_TABLE's first row whose bound covers num_pairs."""
    if dtype == torch.float32:
        return dict(FP32_TILES)
    tiles = next(tiles for most, tiles in TILE_TABLE if most is None or num_pairs <= most)
    return dict(GROUP_TILES if tiles["decode"] == "scaled" and not HAS_DOT_SCALED else tiles)


def _as_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise ValueError(f"fused_moe_mxfp4: {name} must be e8m0 (uint8 bytes or float8_e8m0fnu), got {scale.dtype}")
    return scale


def check_mxfp4_experts(gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                        down_scale: torch.Tensor, hidden: int) -> int:
    """ValueError unless the four tensors are one MXFP4 expert set over `hidden`; returns the expert width I."""
    if gate_up.dtype != torch.int8 or down.dtype != torch.int8:
        raise ValueError(f"fused_moe_mxfp4 takes int8-packed e2m1 experts, got {gate_up.dtype} / {down.dtype}")
    e, two_i, half_h = gate_up.shape
    inter = two_i // 2
    want = {"gate_up": (e, 2 * inter, hidden // 2), "gate_up_scale": (e, 2 * inter, hidden // MX_BLOCK),
            "down": (e, hidden, inter // 2), "down_scale": (e, hidden, inter // MX_BLOCK)}
    got = {"gate_up": gate_up.shape, "gate_up_scale": gate_up_scale.shape, "down": down.shape,
           "down_scale": down_scale.shape}
    if hidden % MX_BLOCK or inter % MX_BLOCK or two_i % 2:
        raise ValueError(f"fused_moe_mxfp4: hidden {hidden} and expert width {inter} must be multiples of {MX_BLOCK}")
    for name, shape in got.items():
        if tuple(shape) != want[name]:
            raise ValueError(f"fused_moe_mxfp4: {name} shape {tuple(shape)} != {want[name]} (two e2m1 per byte, one "
                             f"e8m0 per {MX_BLOCK} elements along K, hidden {hidden}, expert width {inter})")
    return inter


def fused_moe_mxfp4(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                    down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    swiglu_limit: float | None = None, config: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """x (T, H) 16/32-bit; MXFP4 experts (module docstring); weights (T, k) fp32; ids (T, k) -> sum_k weights *
    down(swiglu(gate x, up x)), (T, H) in x's dtype; swiglu_limit clamps as V4's experts do (None: plain SwiGLU).
    config: fixed BLOCK_N / BLOCK_K (a power of two >= 32) / num_warps / num_stages, decode "group" (the hand
    decode, _mx_group_tile; JOIN: one dot over the re-interleaved tile instead of two over the even and odd
    columns), "scaled" (tl.dot_scaled: Triton's own upcast of e2m1 x e8m0 to the activations' 16-bit format) or
    "gemv" (one program row per pair, fp32 products on the CUDA cores: deepinfer_kernels.fused_moe_mxfp4_gemv);
    None: _tiles. pdl: the GEMV form's launches and the slot sum as programmatic dependent ones."""
    t, k = ids.shape
    hidden = x.shape[1]
    inter = check_mxfp4_experts(gate_up, gate_up_scale, down, down_scale, hidden)
    gate_up_scale, down_scale = _as_bytes(gate_up_scale, "gate_up_scale"), _as_bytes(down_scale, "down_scale")
    if not all(a.is_contiguous() for a in (x, gate_up, down, gate_up_scale, down_scale)):
        raise ValueError("fused_moe_mxfp4 needs contiguous x, expert weights and scales")
    e = gate_up.shape[0]
    num_pairs = t * k
    config = dict(config or _tiles(num_pairs, x.dtype))
    decode = config.pop("decode", "group")
    if decode not in DECODES:
        raise ValueError(f"fused_moe_mxfp4: decode must be one of {DECODES}, got {decode!r}")
    if decode != "group" and config.get("JOIN"):
        raise ValueError("fused_moe_mxfp4: JOIN needs the group decode")
    if decode == "scaled" and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fused_moe_mxfp4: decode 'scaled' (tl.dot_scaled) takes bf16 / fp16 activations, got {x.dtype}")
    if config["BLOCK_K"] % MX_BLOCK or config["BLOCK_K"] & (config["BLOCK_K"] - 1):
        raise ValueError(f"fused_moe_mxfp4: BLOCK_K {config['BLOCK_K']} must be a power of two >= {MX_BLOCK}")
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    h = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)
    if decode == "gemv":  # one program row per (token, slot) pair, in pair order: no sort, no padding
        config.pop("JOIN", None)
        gemv_experts(x, gate_up, gate_up_scale, down, down_scale, weights, ids, limit, h, y, config, pdl)
        return combine_slots(y, t, k, hidden, pdl)
    blocks = pair_blocks(ids, e)
    join = config.pop("JOIN", False)
    common = dict(BLOCK_M=blocks.block_m, PER_PAIR=blocks.per_pair, **config)
    if decode == "scaled":
        gate_up_kernel, down_kernel = _gate_up_mxfp4_s, _down_mxfp4_s
        common["FMT"] = "bf16" if x.dtype == torch.bfloat16 else "fp16"
    else:
        gate_up_kernel, down_kernel = _gate_up_mxfp4_g, _down_mxfp4_g
        common.update(IEEE=x.dtype == torch.float32, JOIN=join)
    gate_up_kernel[(blocks.num_blocks, triton.cdiv(inter, config["BLOCK_N"]))](
        x, gate_up, gate_up_scale, h, *blocks.tensors, num_pairs, k, inter, hidden, limit,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1),
        h.stride(0), **common)
    down_kernel[(blocks.num_blocks, triton.cdiv(hidden, config["BLOCK_N"]))](
        h, down, down_scale, y, weights.flatten().float().contiguous(), *blocks.tensors,
        num_pairs, hidden, inter, h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
        down_scale.stride(1), y.stride(0), **common)
    return combine_slots(y, t, k, hidden)
