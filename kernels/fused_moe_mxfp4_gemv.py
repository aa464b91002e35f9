"""The GEMV form of the fused MXFP4 MoE (deepinfer_kernels.fused_moe_mxfp4, decode="gemv"): one program row per
(token, slot) pair, in pair order (no sort, no padding), the e2m1 codes placed as fp16 bits and widened to fp32, the
products and each 32-element group's sum on the CUDA cores in fp32, one scale multiply per group, no 16-bit weight
tile and no tensor cores. It decodes an expert's codes once per pair, so it wins while an expert sees about one pair
(one decode token: fused_moe_mxfp4.TILE_TABLE) and loses once pairs share experts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait


@triton.jit
def _mx_gemv_part(b, s, x_even, x_odd):
    """The GEMV decode: b a (BLOCK_N, G, 16) int8 tile of packed bytes (16 per e8m0 group, contiguous along K),
    s its (BLOCK_N, G) scale bytes, x_even / x_odd the (1, G, 16) fp32 activations of the low / high nibbles ->
    (BLOCK_N, G) fp32 partial sums: each group's 32 products summed, then scaled once per group. The codes are
    placed as fp16 bits (value x 2^-14, as _mx_group_tile) and widened to fp32, exact; the 2^14 goes into the
    group's scale, so no element is multiplied by its scale and no 16-bit weight tile is formed."""
    b = b.to(tl.int16)
    w_lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    w_hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    part = tl.sum(w_lo * x_even + w_hi * x_odd, axis=2)
    s = s.to(tl.int32) & 0xFF
    return part * ((tl.minimum(s, 241) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _gemv_masks(offs_g, byte, nmask, K, k0):
    """The masks of the K tile at k0: activations (G, 16), weight bytes (BLOCK_N, G, 16), scales (BLOCK_N, G)."""
    gmask = offs_g < (K - k0) // 32
    xmask = gmask[:, None] & (byte >= 0)
    return xmask, nmask[:, None, None] & xmask[None, :, :], nmask[:, None] & gmask[None, :]


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_mxfp4_v(X, W, WS, H, PairExpert, num_pairs, top_k, N, K, limit,
                     stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """GEMV form of the gate_up kernel: one (token, slot) pair per program row, products and sums on the CUDA
    cores in fp32 (no tensor cores, no 16-bit operand tile). An expert's weights are decoded once per pair; its
    pairs' programs run in the same column wave, so its bytes come from DRAM once and from L2 after. The next K
    tile's bytes and scales are loaded before this tile is decoded (two tiles in flight per program)."""
    pdl_wait(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 32
    e = tl.load(PairExpert + pair).to(tl.int64)
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_g = tl.arange(0, G)
    byte = offs_g[:, None] * 16 + tl.arange(0, 16)[None, :]  # (G, 16)
    rows = offs_n.to(tl.int64)
    g_ptrs = W + e * stride_we + rows[:, None, None] * stride_wn + byte[None, :, :]
    u_ptrs = g_ptrs + N * stride_wn
    gs_ptrs = WS + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    us_ptrs = gs_ptrs + N * stride_sn
    x_ptrs = X + tok * stride_xm + 2 * byte
    acc_g = tl.zeros([BLOCK_N, G], tl.float32)
    acc_u = tl.zeros([BLOCK_N, G], tl.float32)
    xmask, wmask, smask = _gemv_masks(offs_g, byte, nmask, K, 0)
    b_g = tl.load(g_ptrs, mask=wmask, other=0)
    b_u = tl.load(u_ptrs, mask=wmask, other=0)
    s_g = tl.load(gs_ptrs, mask=smask, other=127)
    s_u = tl.load(us_ptrs, mask=smask, other=127)
    for k0 in range(0, K, BLOCK_K):
        next_xmask, next_wmask, next_smask = _gemv_masks(offs_g, byte, nmask, K, k0 + BLOCK_K)
        next_b_g = tl.load(g_ptrs + BLOCK_K // 2, mask=next_wmask, other=0)
        next_b_u = tl.load(u_ptrs + BLOCK_K // 2, mask=next_wmask, other=0)
        next_s_g = tl.load(gs_ptrs + G, mask=next_smask, other=127)
        next_s_u = tl.load(us_ptrs + G, mask=next_smask, other=127)
        x_even = tl.load(x_ptrs, mask=xmask, other=0.0).to(tl.float32)[None, :, :]
        x_odd = tl.load(x_ptrs + 1, mask=xmask, other=0.0).to(tl.float32)[None, :, :]
        acc_g += _mx_gemv_part(b_g, s_g, x_even, x_odd)
        acc_u += _mx_gemv_part(b_u, s_u, x_even, x_odd)
        b_g, b_u, s_g, s_u, xmask = next_b_g, next_b_u, next_s_g, next_s_u, next_xmask
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K // 2
        u_ptrs += BLOCK_K // 2
        gs_ptrs += G
        us_ptrs += G
    gate = tl.minimum(tl.sum(acc_g, axis=1), limit)
    up = tl.minimum(tl.maximum(tl.sum(acc_u, axis=1), -limit), limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(H + pair.to(tl.int64) * stride_hm + offs_n, h.to(H.dtype.element_ty), mask=nmask)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_mxfp4_v(A, W, WS, Y, TopkWeights, PairExpert, num_pairs, N, K,
                  stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """GEMV form of the down kernel (as _gate_up_mxfp4_v), each pair's fp32 result scaled by its top-k weight."""
    pdl_wait(PDL)
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // 32
    e = tl.load(PairExpert + pair).to(tl.int64)
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_g = tl.arange(0, G)
    byte = offs_g[:, None] * 16 + tl.arange(0, 16)[None, :]
    rows = offs_n.to(tl.int64)
    w_ptrs = W + e * stride_we + rows[:, None, None] * stride_wn + byte[None, :, :]
    s_ptrs = WS + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :]
    a_ptrs = A + pair64 * stride_am + 2 * byte
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    amask, wmask, smask = _gemv_masks(offs_g, byte, nmask, K, 0)
    b = tl.load(w_ptrs, mask=wmask, other=0)
    s = tl.load(s_ptrs, mask=smask, other=127)
    for k0 in range(0, K, BLOCK_K):
        next_amask, next_wmask, next_smask = _gemv_masks(offs_g, byte, nmask, K, k0 + BLOCK_K)
        next_b = tl.load(w_ptrs + BLOCK_K // 2, mask=next_wmask, other=0)
        next_s = tl.load(s_ptrs + G, mask=next_smask, other=127)
        a_even = tl.load(a_ptrs, mask=amask, other=0.0).to(tl.float32)[None, :, :]
        a_odd = tl.load(a_ptrs + 1, mask=amask, other=0.0).to(tl.float32)[None, :, :]
        acc += _mx_gemv_part(b, s, a_even, a_odd)
        b, s, amask = next_b, next_s, next_amask
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
        s_ptrs += G
    y = tl.sum(acc, axis=1) * tl.load(TopkWeights + pair64)
    tl.store(Y + pair64 * stride_ym + offs_n, y.to(Y.dtype.element_ty), mask=nmask)


def gemv_experts(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                 down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float, h: torch.Tensor,
                 y: torch.Tensor, config: dict, pdl: bool = False) -> None:
    """Both GEMMs of the GEMV form into h (T*k, I) and y (T*k, H), pair order; the arguments as checked by
    fused_moe_mxfp4 (scales as uint8 bytes); config: BLOCK_N, BLOCK_K, num_warps, num_stages."""
    t, k = ids.shape
    num_pairs, inter, hidden = t * k, h.shape[1], x.shape[1]
    if not num_pairs:
        return
    flat_ids = ids.flatten()
    _gate_up_mxfp4_v[(num_pairs, triton.cdiv(inter, config["BLOCK_N"]))](
        x, gate_up, gate_up_scale, h, flat_ids, num_pairs, k, inter, hidden, limit, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0), **config,
        **pdl_launch(pdl))
    _down_mxfp4_v[(num_pairs, triton.cdiv(hidden, config["BLOCK_N"]))](
        h, down, down_scale, y, weights.flatten().float().contiguous(), flat_ids, num_pairs, hidden, inter,
        h.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1), y.stride(0), **config,
        **pdl_launch(pdl))
