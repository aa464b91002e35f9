"""The GEMV form of the FP8 fused MoE (deepinfer_kernels.fused_moe_fp8, decode-sized batches): two launches, no
sort, no padding, no quantized copy of the activations.

    gate_up   one program per ((token, slot) pair, N tile): the token's activations quantized in registers, group
              by group (the W8A8 scheme of fp8_quant: amax / 448 per bk channels), times the pair's expert rows
              widened to fp32 on the CUDA cores; h = silu(gate) * up in x's dtype
    down      one program per (token, N tile): each slot's pair in slot order (h quantized the same way), its fp32
              result times the top-k weight rounded to x's dtype and added in fp32, as combine_slots adds them

The values are those of the tiled form (the same quantized activations, the same exact products summed in fp32,
the same per-pair rounding before the slots are added): only the order of the fp32 sums differs. Each K step reads
a (BLOCK_N, BLOCK_K) tile of e4m3 bytes as BLOCK_K / bk scale groups; the next step's tile and scales are loaded
before this one is used (two tiles in flight per program). An expert's bytes are read once per pair that takes it,
so the form wins while pairs rarely share experts (one or two decode tokens) and loses once they do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.fp8_quant import FP8_MAX, MIN_AMAX


@triton.jit
def _quantized(a, IS_INTERPRETED: tl.constexpr):
    """a (G, GROUP) fp32 activations -> (their e4m3 values as fp32, (G,) scales): per group amax / 448, as
    fp8_quant._quantize_token_groups_kernel computes them (the interpreter rounds to e4m3's grid in fp32, its own
    cast can drop a carry)."""
    amax = tl.maximum(tl.max(tl.abs(a), axis=1), MIN_AMAX)
    scale = amax / FP8_MAX
    v = tl.clamp(a / scale[:, None], -FP8_MAX, FP8_MAX)
    if IS_INTERPRETED:
        ulp = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(v), 0.015625))) - 3.0)
        rounded = tl.floor(tl.abs(v) / ulp + 0.5) * ulp
        v = tl.where(v < 0, -rounded, rounded)
    else:
        v = v.to(tl.float8e4nv).to(tl.float32)
    return v, scale


@triton.jit
def _tile(W, WS, e, kb, row0, srow0, offs_n, nmask, col, offs_g, K, stride_we, stride_wn, stride_se, stride_sn,
          GROUP_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Expert e's rows row0 + offs_n at K step kb: the (BLOCK_N, G, GROUP) e4m3 tile and its (BLOCK_N, G) scales
    (scale rows srow0 + offs_n // GROUP_N); columns past K read 0, and their groups' scales 0."""
    k0 = kb * BLOCK_K
    kmask = col < K - k0
    rows = (row0 + offs_n).to(tl.int64)
    w = tl.load(W + e * stride_we + rows[:, None, None] * stride_wn + k0 + col[None, :, :],
                mask=nmask[:, None, None] & kmask[None, :, :], other=0.0)
    gmask = offs_g * GROUP < K - k0
    s = tl.load(WS + e * stride_se + (srow0 + offs_n // GROUP_N)[:, None] * stride_sn + kb * (BLOCK_K // GROUP)
                + offs_g[None, :], mask=nmask[:, None] & gmask[None, :], other=0.0)
    return w, s


@triton.jit
def _part(w, s, v, a_scale):
    """sum over each group of w * v (fp32), scaled by the group's activation and weight scales: (BLOCK_N, G)."""
    return tl.sum(w.to(tl.float32) * v[None, :, :], axis=2) * a_scale[None, :] * s


@triton.jit
def _gate_up_fp8_v(X, W, WS, H, Ids, top_k, N, K, up_row0, stride_xm, stride_we, stride_wn, stride_se, stride_sn,
                   stride_hm, GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // GROUP
    e = tl.load(Ids + pair).to(tl.int64)
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_g = tl.arange(0, G)
    col = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # (G, GROUP) within a K step
    acc_g = tl.zeros([BLOCK_N, G], tl.float32)
    acc_u = tl.zeros([BLOCK_N, G], tl.float32)
    args = (K, stride_we, stride_wn, stride_se, stride_sn, GROUP_N, BLOCK_K, GROUP)
    g, sg = _tile(W, WS, e, 0, 0, 0, offs_n, nmask, col, offs_g, *args)
    u, su = _tile(W, WS, e, 0, N, up_row0, offs_n, nmask, col, offs_g, *args)
    nk = tl.cdiv(K, BLOCK_K)
    for kb in range(nk):
        nxt = tl.minimum(kb + 1, nk - 1)  # the last step loads its own tile again: no mask, in bounds
        next_g, next_sg = _tile(W, WS, e, nxt, 0, 0, offs_n, nmask, col, offs_g, *args)
        next_u, next_su = _tile(W, WS, e, nxt, N, up_row0, offs_n, nmask, col, offs_g, *args)
        a = tl.load(X + tok * stride_xm + kb * BLOCK_K + col, mask=col < K - kb * BLOCK_K, other=0.0)
        v, a_scale = _quantized(a.to(tl.float32), IS_INTERPRETED)
        acc_g += _part(g, sg, v, a_scale)
        acc_u += _part(u, su, v, a_scale)
        g, sg, u, su = next_g, next_sg, next_u, next_su
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(H + pair.to(tl.int64) * stride_hm + offs_n, h.to(H.dtype.element_ty), mask=nmask)


@triton.jit
def _down_fp8_v(A, W, WS, Y, TopkWeights, Ids, top_k, N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                stride_ym, GROUP_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP: tl.constexpr, IS_INTERPRETED: tl.constexpr):
    """One program per (token, N tile): its top_k pairs one after another, K steps of all of them in one loop
    (step it = slot * nk + kb) so that the next slot's first tile is in flight while this slot ends."""
    tok = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    G: tl.constexpr = BLOCK_K // GROUP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_g = tl.arange(0, G)
    col = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    args = (K, stride_we, stride_wn, stride_se, stride_sn, GROUP_N, BLOCK_K, GROUP)
    nk = tl.cdiv(K, BLOCK_K)
    steps = top_k * nk
    e = tl.load(Ids + tok * top_k).to(tl.int64)
    w, s = _tile(W, WS, e, 0, 0, 0, offs_n, nmask, col, offs_g, *args)
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    out = tl.zeros([BLOCK_N], tl.float32)
    for it in range(steps):
        nxt = tl.minimum(it + 1, steps - 1)
        next_e = tl.load(Ids + tok * top_k + nxt // nk).to(tl.int64)
        next_w, next_s = _tile(W, WS, next_e, nxt % nk, 0, 0, offs_n, nmask, col, offs_g, *args)
        pair = tok * top_k + it // nk
        kb = it % nk
        a = tl.load(A + pair * stride_am + kb * BLOCK_K + col, mask=col < K - kb * BLOCK_K, other=0.0)
        v, a_scale = _quantized(a.to(tl.float32), IS_INTERPRETED)
        acc += _part(w, s, v, a_scale)
        last = kb == nk - 1
        y = (tl.sum(acc, axis=1) * tl.load(TopkWeights + pair)).to(Y.dtype.element_ty).to(tl.float32)
        out += tl.where(last, y, 0.0)
        acc = tl.where(last, 0.0, acc)
        w, s = next_w, next_s
    tl.store(Y + tok * stride_ym + offs_n, out.to(Y.dtype.element_ty), mask=nmask)


GEMV_TILES = dict(BLOCK_N=16, BLOCK_K=256, DOWN_BLOCK_N=16, DOWN_BLOCK_K=512, num_warps=4)
"""The GEMV form's tiles (gate_up's, then down's; BLOCK_K a multiple of the scale block)."""


def gemv_experts_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                     down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, block: tuple[int, int],
                     config: dict | None = None) -> torch.Tensor:
    """(T, H) in x's dtype: the arguments as fused_moe_fp8 checks them; config: GEMV_TILES' keys."""
    t, k = ids.shape
    inter, hidden = gate_up.shape[1] // 2, x.shape[1]
    bn, bk = block
    tiles = dict(GEMV_TILES, **(config or {}))
    for key in ("BLOCK_K", "DOWN_BLOCK_K"):
        if tiles[key] % bk or tiles[key] & (tiles[key] - 1):
            raise ValueError(f"gemv_experts_fp8: {key} {tiles[key]} must be a power-of-two multiple of {bk}")
    warps = dict(num_warps=tiles["num_warps"])
    interpreted = x.device.type == "cpu"
    flat_ids = ids.flatten().contiguous()
    h = x.new_empty(t * k, inter)
    y = x.new_empty(t, hidden)
    if not t:
        return y
    _gate_up_fp8_v[(t * k, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, gate_up, gate_up_scale, h, flat_ids, k, inter, hidden, triton.cdiv(inter, bn), x.stride(0),
        gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0),
        GROUP_N=bn, BLOCK_N=tiles["BLOCK_N"], BLOCK_K=tiles["BLOCK_K"], GROUP=bk, IS_INTERPRETED=interpreted, **warps)
    _down_fp8_v[(t, triton.cdiv(hidden, tiles["DOWN_BLOCK_N"]))](
        h, down, down_scale, y, weights.flatten().float().contiguous(), flat_ids, k, hidden, inter, h.stride(0),
        down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1), y.stride(0),
        GROUP_N=bn, BLOCK_N=tiles["DOWN_BLOCK_N"], BLOCK_K=tiles["DOWN_BLOCK_K"], GROUP=bk,
        IS_INTERPRETED=interpreted, **warps)
    return y
