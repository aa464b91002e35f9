"""Fused mixture-of-experts with block-scaled FP8 expert weights (DeepSeek-V3/R1 release format) in Triton: W8A8
grouped GEMMs over (token, slot) pairs sorted by expert, as in deepinfer_kernels.fused_moe.

    gate_up (E, 2I, H) float8_e4m3fn, scale (E, 2 ceil(I/bn), ceil(H/bk)) float32: gate's row blocks, then up's
    down    (E, H, I)  float8_e4m3fn, scale (E, ceil(H/bn), ceil(I/bk)) float32

The activations are quantized once before each GEMM (deepinfer_kernels.fp8_quant: per token, or per pair for
down, and per bk-channel group, amax / 448, the releases' dynamic scheme), not again inside every N tile: the
K loop then only streams e4m3 bytes and their scales, and software pipelining keeps the weight loads in flight.
Each K step is one BLOCK_K = bk slice: one fp8 tensor-core dot of exact products summed in fp32, scaled by the
row's activation scale and each column's weight block scale, into an fp32 accumulator:

    acc[m, n] += dot(q(a)[m, k0:k0+bk], w[e, n, k0:k0+bk]) * s_a[m, k0 / bk] * s_w[e, n / bn, k0 / bk]

gate_up writes h = silu(gate) * up in x's dtype; h is quantized the same way for down, which scales each pair's
fp32 result by its top-k weight; the k slots of a token are summed in slot order (fused_moe.combine_slots). No
split-K. With TILED (fused_moe_fp8's `tiled`, experts reordered once by `tile_experts`) each tile of TILE_ROWS weight
rows x BLOCK_K inputs is contiguous memory, the tiles of a row block one after another along K, so a program
streams its rows front to back instead of reading BLOCK_K bytes from each of rows K bytes apart (the layout change
that took the MXFP4 experts from 0.61-0.65 to 0.81-0.96 of the read bandwidth at 16-256 tokens,
fused_moe_mxfp4_frag). On the GPU the N tile, warps and stages are autotuned per (N, K, pair-count bucket, rows per
block) as in fused_moe; BLOCK_K is the scale block. Batch-invariant mode takes one fixed configuration
(INVARIANT_TILES). The torch form is deepinfer_kernels.reference.fused_moe_fp8 (the same activation values:
fp8_quant reproduces the quantization the kernels once did per tile).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait
from deepinfer_kernels.fp8_quant import quantize_fp8_token_groups
from deepinfer_kernels.fused_moe import _even_k, combine_slots, pair_blocks, pair_rows, store_weighted

TILE_ROWS = 64
"""Weight rows of a contiguous tile in the TILED layout (tile_experts)."""
_TILE_ROWS = tl.constexpr(TILE_ROWS)


@triton.jit
def _dot_fp8(a, w, IS_INTERPRETED: tl.constexpr):
    """a (M, BK) float8, w (BK, N) float8 -> their fp32 dot (the interpreter dots exact fp32 copies)."""
    if IS_INTERPRETED:
        return tl.dot(a.to(tl.float32), w.to(tl.float32))
    return tl.dot(a, w)


@triton.jit
def _weight_ptrs(W, e, offs_n, offs_k, stride_we, stride_wn, BLOCK_K: tl.constexpr, TILED: tl.constexpr):
    """(BLOCK_K, BLOCK_N) pointers to expert e's rows offs_n at the first K step, and how far a K step moves them:
    row by row (stride_wn apart), or in the TILED layout (tile_experts: TILE_ROWS x BLOCK_K contiguous tiles)."""
    n = offs_n.to(tl.int64)
    if TILED:
        rows = (n // _TILE_ROWS) * _TILE_ROWS * stride_wn + (n % _TILE_ROWS) * BLOCK_K
        step = _TILE_ROWS * BLOCK_K
    else:
        rows = n * stride_wn
        step = BLOCK_K
    return W + e * stride_we + rows[None, :] + offs_k[:, None], step


# num_pairs and pairs_bucket (the autotuner's key only) are never specialised, as in fused_moe.
@triton.jit(do_not_specialize=["num_pairs", "pairs_bucket"])
def _gate_up_fp8(XQ, XS, W, WS, H, SortedPairs, BlockExpert, NumPadded, num_pairs, pairs_bucket, top_k, N, K,
                 up_row0, stride_xm, stride_xsg, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                 GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PER_PAIR: tl.constexpr, EVEN_K: tl.constexpr, IS_INTERPRETED: tl.constexpr, PDL: tl.constexpr,
                 TILED: tl.constexpr = False):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = XQ + tok[:, None] * stride_xm + offs_k[None, :]
        as_ptrs = XS + tok
        g_ptrs, w_step = _weight_ptrs(W, e, offs_n, offs_k, stride_we, stride_wn, BLOCK_K, TILED)  # (K, N) tiles
        u_ptrs = g_ptrs + N * stride_wn  # tiled too: N is a multiple of TILE_ROWS there
        gs_ptrs = WS + e * stride_se + (offs_n // GROUP_N) * stride_sn
        us_ptrs = WS + e * stride_se + (up_row0 + offs_n // GROUP_N) * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:  # no mask along K: the loads stay vectorised
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
                g = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
                g = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                u = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            a_scale = tl.load(as_ptrs + kb * stride_xsg, mask=mmask, other=0.0)
            g_scale = tl.load(gs_ptrs + kb, mask=nmask, other=0.0)
            u_scale = tl.load(us_ptrs + kb, mask=nmask, other=0.0)
            acc_g += _dot_fp8(a, g, IS_INTERPRETED) * a_scale[:, None] * g_scale[None, :]
            acc_u += _dot_fp8(a, u, IS_INTERPRETED) * a_scale[:, None] * u_scale[None, :]
            a_ptrs += BLOCK_K
            g_ptrs += w_step
            u_ptrs += w_step
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(H + pair.to(tl.int64)[:, None] * stride_hm + offs_n[None, :], h.to(H.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "pairs_bucket"])
def _down_fp8(AQ, AS, W, WS, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, pairs_bucket, N, K,
              stride_am, stride_asg, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
              GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PER_PAIR: tl.constexpr, EVEN_K: tl.constexpr, IS_INTERPRETED: tl.constexpr, PDL: tl.constexpr,
              TILED: tl.constexpr = False):
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        pair64 = pair.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = AQ + pair64[:, None] * stride_am + offs_k[None, :]
        as_ptrs = AS + pair64
        w_ptrs, w_step = _weight_ptrs(W, e, offs_n, offs_k, stride_we, stride_wn, BLOCK_K, TILED)
        ws_ptrs = WS + e * stride_se + (offs_n // GROUP_N) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mmask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = offs_k < K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            a_scale = tl.load(as_ptrs + kb * stride_asg, mask=mmask, other=0.0)
            w_scale = tl.load(ws_ptrs + kb, mask=nmask, other=0.0)
            acc += _dot_fp8(a, w, IS_INTERPRETED) * a_scale[:, None] * w_scale[None, :]
            a_ptrs += BLOCK_K
            w_ptrs += w_step
        store_weighted(Y, TopkWeights, pair64, offs_n, mmask, nmask, acc, stride_ym)


TUNE_CONFIGS = ((32, 4, 4), (64, 4, 3), (64, 4, 5), (128, 4, 3), (128, 4, 4), (128, 8, 4), (256, 8, 3),
                (64, 8, 4))
"""(BLOCK_N, num_warps, num_stages) the autotuner tries on the GPU; BLOCK_K is the scale block. A config that
runs out of shared memory at BLOCK_M 128 (prefill) is scored as infinitely slow, and (32, 4, 4) always fits."""


def _tuned(kernel):
    configs = [triton.Config(dict(BLOCK_N=bn), num_warps=w, num_stages=st) for bn, w, st in TUNE_CONFIGS]
    return triton.autotune(configs, key=["N", "K", "pairs_bucket", "BLOCK_M", "PER_PAIR", "TILED"], warmup=5,
                           rep=20)(_even_k(kernel))


_gate_up_fp8_tuned, _down_fp8_tuned = _tuned(_gate_up_fp8), _tuned(_down_fp8)
_gate_up_fp8_fixed, _down_fp8_fixed = _even_k(_gate_up_fp8), _even_k(_down_fp8)
INTERPRETED_TILES = dict(BLOCK_N=32, num_warps=4, num_stages=1)
"""The tile of interpreted (CPU) runs, where there is nothing to tune."""
INVARIANT_TILES = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
"""Batch-invariant mode's one configuration, whatever the batch (one of TUNE_CONFIGS, at fused_moe's invariant
BLOCK_M): pairs always sorted into 32-row blocks, the same tiles and K steps for every pair."""


def tiles_supported(gate_up: torch.Tensor, block_k: int) -> bool:
    """Whether experts of gate_up's shape (E, 2I, H) take the TILED layout with BLOCK_K = block_k: I and H
    multiples of TILE_ROWS and of block_k (every K step a whole tile)."""
    inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    return all(d % TILE_ROWS == 0 and d % block_k == 0 for d in (inter, hidden))


def tile_experts(w: torch.Tensor, block_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """w (E, R, K) -> the same shape and dtype in the TILED layout: tile (r, c) of TILE_ROWS rows x block_k inputs
    at rows r * TILE_ROWS.., the tiles of a row block in K order, each contiguous. Written to `out` (may be w itself:
    an expert at a time, read before it is written)."""
    e, r, k = w.shape
    if r % TILE_ROWS or k % block_k:
        raise ValueError(f"tile_experts: rows {r} must be a multiple of {TILE_ROWS} and K {k} of {block_k}")
    out = torch.empty_like(w) if out is None else out
    for i in range(e):
        tiled = w[i].view(r // TILE_ROWS, TILE_ROWS, k // block_k, block_k).transpose(1, 2)
        out[i] = tiled.reshape(r, k)  # reshape copies (the transpose is not contiguous): w[i] may be out[i]
    return out


def fused_moe_fp8(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                  down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  block: tuple[int, int] = (128, 128), config: dict | None = None,
                  batch_invariant: bool = False, pdl: bool = False, tiled: bool = False) -> torch.Tensor:
    """x (T, H) 16/32-bit; FP8 experts with their block scales (module docstring); weights (T, k) fp32; ids
    (T, k) -> sum_k weights * down(silu(gate x) * up x), (T, H) in x's dtype. block = (bn, bk) of the weight
    scales; bk (a power of two >= 16) is also the activations' quantization group. config: fixed BLOCK_N /
    num_warps / num_stages instead of the autotuner (tests, sweeps). batch_invariant: each token's result bitwise
    the same in any batch (INVARIANT_TILES; every quantization is per token or per pair, a row of a tile's dot
    depends on its own inputs only, and the slots are summed in order). pdl: the launches as programmatic dependent
    ones (dispatch.pdl_launch; the pairs' sort, where they are sorted, excepted): the same values. tiled: gate_up and
    down are in tile_experts' layout (tiles_supported): the same sums in the same order."""
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
    if tiled and not tiles_supported(gate_up, bk):
        raise ValueError(f"fused_moe_fp8: tiled experts need hidden {hidden} and width {inter} multiples of "
                         f"{TILE_ROWS} and of {bk}")
    num_pairs = t * k
    interpreted = x.device.type == "cpu"
    block_m = None
    if batch_invariant:
        config = dict(INVARIANT_TILES)
        block_m = config.pop("BLOCK_M")
    elif config is None and interpreted:
        config = INTERPRETED_TILES
    if config is None:
        gate_up_kernel, down_kernel, config = _gate_up_fp8_tuned, _down_fp8_tuned, {}
    else:
        gate_up_kernel, down_kernel, config = _gate_up_fp8_fixed, _down_fp8_fixed, dict(config)
    blocks = pair_blocks(ids, e, block_m)
    bucket = triton.next_power_of_2(num_pairs)
    common = dict(GROUP_N=bn, BLOCK_M=blocks.block_m, BLOCK_K=bk, PER_PAIR=blocks.per_pair,
                  IS_INTERPRETED=interpreted, TILED=bool(tiled), **config, **pdl_launch(pdl))
    xq, xs = quantize_fp8_token_groups(x, bk, pdl=pdl)
    h = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)
    gate_up_kernel[lambda meta: (blocks.num_blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        xq, xs, gate_up, gate_up_scale, h, *blocks.tensors, num_pairs, bucket, k, inter, hidden,
        triton.cdiv(inter, bn), xq.stride(0), xs.stride(1), gate_up.stride(0), gate_up.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0), **common)
    hq, hs = quantize_fp8_token_groups(h, bk, pdl=pdl)
    down_kernel[lambda meta: (blocks.num_blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](
        hq, hs, down, down_scale, y, weights.flatten().float().contiguous(), *blocks.tensors,
        num_pairs, bucket, hidden, inter, hq.stride(0), hs.stride(1), down.stride(0), down.stride(1),
        down_scale.stride(0), down_scale.stride(1), y.stride(0), **common)
    return combine_slots(y, t, k, hidden, pdl)
