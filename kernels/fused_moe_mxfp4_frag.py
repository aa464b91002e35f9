"""Fused MXFP4 MoE over experts repacked at load into the order Hopper's tensor cores take them from registers.

Why: the plain form (fused_moe_mxfp4, `tl.dot_scaled`) decodes e2m1 in about 7.5 instructions an element (SASS of
its loop on sm90: byte-wide shared-memory reads, a lookup decode, the scale's broadcast) and reads each weight row
64 bytes at a time, 1-2 KB apart: at decode batch sizes it reaches about half the read bandwidth. Here the expert
weight is the wgmma's A operand (BLOCK_N weight rows x 128 K, in registers) and the tokens its B operand (acc is
(BLOCK_N, BLOCK_M), transposed at the store); the weight bytes and their scales are repacked once at load (same
bytes, same shapes) so that

- a tile of 64 rows x 128 K elements is 4 KB of contiguous memory (TILE_ROWS rows of 64 bytes, the chunks of a row
  block one after another along K), and its 256 scale bytes are contiguous too: a program streams its row block
  front to back. Read row by row (64 bytes every 1-2 KB, the release order) the same kernel reached 0.54-0.65 of the
  read bandwidth at 1-256 tokens on an H100; tiled, 0.71-0.96 (benchmark/results/gpu_mxfp4_frag_tiles_h100.json);
- each 32-bit word holds the 8 codes one thread multiplies together, and a thread's four words are 16 contiguous
  bytes (one 128-bit load);
- each code sits where a shift and a mask turn it into a bf16 whose value is the code's x 2^-126: sign at bit
  15 - s, exponent and mantissa bits at 8 - s .. 6 - s of a 16-bit half for s = 0, 3, 6 (three codes per half),
  the fourth code at bits 14, 13, 11-10; the 2^126 goes into the e8m0 scale's multiplier (2^(b - 1) as a bf16,
  exact for scale bytes b <= 128: FAST), or, past that, a separate multiply.

The decode is plain Triton integer ops and one `mul.bf16x2` a word (inline, element by element: its result does not
depend on the layout Triton picks; Triton's own bf16 product left the fourth code's halves unpaired, two byte
permutes a word); Triton's interpreter runs the same integer decode, its bf16 halves taken through fp32. Word c
(thread t = c // 4, word w' = c % 4) of a chunk, byte-slot j (j0 = j % 2, j1 = j // 2), half p holds element

    k = 32 w' + 16 j1 + 8 j0 + 2 t + p                                   (fragment_order)

and the tile's rows are read in the order i = 8 NW r + 8 w + g for weight row 8 R w + 8 r + g (R = BLOCK_N /
(8 NW)), so that a warp's rows are the ones its wgmma fragment holds. Needs K a multiple of 128, N of 128 and of
BLOCK_N; bf16 activations.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer_kernels.fused_moe import (PER_PAIR_MAX, combine_slots, pair_blocks, pair_rows, store_swiglu,
                                        store_weighted)
from deepinfer_kernels.fused_moe_mxfp4 import _as_bytes, check_mxfp4_experts

CHUNK = 128
"""K elements per repacked chunk (64 bytes of a weight row)."""
_CHUNK = tl.constexpr(CHUNK)
TILE_ROWS = 64
"""Rows of a contiguous tile (TILE_ROWS x 64 bytes a chunk); BLOCK_N is a multiple of it."""
_TILE_ROWS = tl.constexpr(TILE_ROWS)
_TILE_WORDS = tl.constexpr(TILE_ROWS * CHUNK // 8)
_TILE_SCALES = tl.constexpr(TILE_ROWS * CHUNK // 32)
FAST_MAX_SCALE = 128
"""Largest e8m0 byte whose multiplier 2^(b - 1) is a finite bf16: the one-multiply decode (FAST)."""
FRAG_TILES = dict(BLOCK_N=64, num_warps=4, num_stages=3)
WIDE_TILES = dict(BLOCK_N=128, num_warps=4, num_stages=3)
FRAG_TILE_TABLE = ((2048, FRAG_TILES), (None, WIDE_TILES))
"""(most pairs, tiles), first match wins; but row blocks of 128 pairs (pair_blocks at prefill sizes) keep FRAG_TILES:
the gate_up kernel at 128 x 128 spills registers (its SASS, compiled for sm90). 64-row tiles load the next chunk's
scales a step ahead (AHEAD; with it at 128 rows Triton stages the decoded tile through shared memory). V4-Flash's
experts on an H100, tiled layout (bench_kernels.py --only mxfp4, results/gpu_mxfp4_frag_tile_layout_h100.json):
47.6 / 463 / 997 / 1,370 us at 1 / 16 / 64 / 256 tokens (0.73 / 0.94 / 0.97 / 0.81 of the read bandwidth) against
63.8 / 683 / 1,470 / 1,946 row by row at 64 x 128 tiles of 4 stages in the same call; at 2,048 tokens 128-row tiles
3,518 us against 3,823 at 64 rows (results/gpu_mxfp4_frag_tiles_h100.json)."""


SMALL_BLOCK_PAIRS_PER_EXPERT = 8
"""Below this many pairs an expert (past PER_PAIR_MAX pairs), rows are sorted into 16-pair blocks where fused_moe's
rule takes 32: gate_up at 16 pairs holds 123 registers against 140 (sm90 SASS), four programs a multiprocessor
instead of three. V4-Flash's experts at 256 tokens (6 pairs an expert) on an H100: 1,264 us against 1,363 (0.89
against 0.83 of the read bandwidth); at 2,048 tokens 16-pair blocks lose (5,159 against 3,566 us at 128 rows;
results/gpu_mxfp4_frag_m16_h100.json)."""


def _block_m(num_pairs: int, num_experts: int) -> int | None:
    """The row block the kernels take where the caller names none: 16 pairs at decode sizes, else fused_moe's."""
    return 16 if PER_PAIR_MAX < num_pairs < SMALL_BLOCK_PAIRS_PER_EXPERT * num_experts else None


def _frag_tiles(num_pairs: int, block_m: int) -> dict:
    if block_m >= 128:
        return dict(FRAG_TILES)
    return dict(next(tiles for most, tiles in FRAG_TILE_TABLE if most is None or num_pairs <= most))


def fragment_order(device=None) -> torch.Tensor:
    """(16 words, 4 byte-slots, 2 halves) -> the element (0..127) of a 128-element chunk each code holds."""
    c = torch.arange(16, device=device)[:, None, None]
    j = torch.arange(4, device=device)[None, :, None]
    p = torch.arange(2, device=device)[None, None, :]
    return 32 * (c % 4) + 16 * (j // 2) + 8 * (j % 2) + 2 * (c // 4) + p


def _half16(codes: torch.Tensor) -> torch.Tensor:
    """codes (..., 4 byte-slots) int32 e2m1 -> the 16-bit half holding them."""
    out = codes[..., 3].bitwise_and(12) << 11 | codes[..., 3].bitwise_and(3) << 10
    for j, s in ((0, 0), (1, 3), (2, 6)):
        out = out | codes[..., j].bitwise_and(8) << (12 - s) | codes[..., j].bitwise_and(7) << (6 - s)
    return out


def fragment_supported(rows: int, k: int, block_n: int | None = None) -> bool:
    """Whether a (rows, k) expert weight runs in this form: k a multiple of CHUNK, rows of TILE_ROWS and block_n
    (None: of every tile of FRAG_TILE_TABLE)."""
    block_n = block_n or max(tiles["BLOCK_N"] for _, tiles in FRAG_TILE_TABLE)
    return k % CHUNK == 0 and rows % TILE_ROWS == 0 and rows % block_n == 0


def repack_fragment(packed: torch.Tensor, out: torch.Tensor | None = None, max_elements: int = 1 << 25) -> torch.Tensor:
    """packed (E, R, K/2) int8 (two e2m1 per byte, element 2j in the low nibble, as the releases store them) ->
    the same shape and dtype in the fragment order and bit placement, in tiles of TILE_ROWS rows (module docstring),
    on packed's device, written to `out` (may be packed itself: a few experts at a time, each read before it is
    written)."""
    e, r, half = packed.shape
    if not fragment_supported(r, 2 * half, 1):
        raise ValueError(f"repack_fragment: K = {2 * half} must be a multiple of {CHUNK} and rows = {r} of "
                         f"{TILE_ROWS}")
    chunks = 2 * half // CHUNK
    src = fragment_order(packed.device).flatten()
    out = torch.empty_like(packed) if out is None else out
    step = max(1, max_elements // (r * 2 * half))
    for e0 in range(0, e, step):
        u = packed[e0:e0 + step].view(torch.uint8).to(torch.int32).reshape(-1, chunks, CHUNK // 2)
        codes = torch.stack([u & 15, u >> 4], -1).reshape(-1, chunks, CHUNK)[..., src]
        codes = codes.reshape(-1, chunks, 16, 4, 2)
        lo, hi = _half16(codes[..., 0]), _half16(codes[..., 1])
        word = torch.stack([lo & 255, lo >> 8, hi & 255, hi >> 8], -1).to(torch.uint8)  # little-endian bytes
        word = word.reshape(-1, r // TILE_ROWS, TILE_ROWS, chunks, CHUNK // 2).transpose(2, 3)  # row blocks, chunks
        out[e0:e0 + step] = word.reshape(-1, r, half).view(torch.int8)
    return out


def repack_scales(scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """scale (E, R, K/32) e8m0 bytes (any one-byte dtype) -> the same shape in the tiles of repack_fragment: the
    TILE_ROWS x 4 bytes of a row block's chunk contiguous. Written to `out` (may be scale itself)."""
    e, r, groups = scale.shape
    if r % TILE_ROWS or groups % (CHUNK // 32):
        raise ValueError(f"repack_scales: rows = {r} must be a multiple of {TILE_ROWS} and K / 32 = {groups} of "
                         f"{CHUNK // 32}")
    tiled = scale.view(torch.uint8).reshape(e, r // TILE_ROWS, TILE_ROWS, groups // 4, 4).transpose(2, 3)
    out = torch.empty_like(scale) if out is None else out
    out.view(torch.uint8).copy_(tiled.reshape(e, r, groups))  # reshape copies: out may be scale
    return out


def fast_scales(*scales: torch.Tensor) -> bool:
    """Whether every e8m0 byte allows the one-multiply decode (FAST_MAX_SCALE); one host read, at load."""
    return all(int(s.view(torch.uint8).max()) <= FAST_MAX_SCALE for s in scales if s.numel())


@triton.jit
def _bf16_halves(o, F32: tl.constexpr):
    """A word of two bf16 bit patterns -> its low and high halves (F32: as fp32 values, for the interpreter,
    whose bf16 bitcasts do not keep these small numbers; the same values)."""
    if F32:
        lo = (o << 16).to(tl.float32, bitcast=True)
        hi = (o & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        lo = (o & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = ((o >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _mul_bf16x2(d, mm):
    """Words of two bf16 each times words of two bf16 multipliers, lane by lane (one mul.bf16x2 a word: Triton's
    own bf16 product of the halves is not always paired back into one instruction)."""
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [d, mm], dtype=tl.uint32, is_pure=True,
                                     pack=1)


@triton.jit
def _frag_tile(w_ptrs, sc, BLOCK_N: tl.constexpr, NW: tl.constexpr, FAST: tl.constexpr, F32: tl.constexpr):
    """One K chunk of the tile: w_ptrs (BLOCK_N, 16) int32 words, sc (BLOCK_N, 4) its e8m0 bytes (loaded), rows in
    tile order -> (BLOCK_N weight rows, 128) bf16, the dequantized weights in weight-row and element order."""
    wd = tl.load(w_ptrs).to(tl.uint32, bitcast=True)
    sc = sc.to(tl.uint32)
    d0 = wd & 0x81C081C0
    d1 = (wd << 3) & 0x81C081C0
    d2 = (wd << 6) & 0x81C081C0
    d3 = ((wd << 1) & 0x80008000) | ((wd >> 5) & 0x01000100) | ((wd >> 4) & 0x00C000C0)
    if not F32:  # scaled as words (bf16 pairs), word c = 4 t + w' scaled by its row's w'-th byte
        if FAST:  # 2^(b - 1) = 2^(b - 127) x 2^126, one bf16 multiply
            m = (sc + 126) << 7
        else:  # 2^126, then 2^(b - 127)
            m = tl.where(sc == 0, 64, sc << 7)
        mm = tl.broadcast_to((m | (m << 16)).reshape(BLOCK_N, 1, 4), (BLOCK_N, 4, 4)).reshape(BLOCK_N, 16)
        if not FAST:
            two126 = tl.full([1, 1], 0x7E807E80, tl.uint32)
            d0, d1, d2, d3 = (_mul_bf16x2(d0, two126), _mul_bf16x2(d1, two126), _mul_bf16x2(d2, two126),
                              _mul_bf16x2(d3, two126))
        d0, d1, d2, d3 = _mul_bf16x2(d0, mm), _mul_bf16x2(d1, mm), _mul_bf16x2(d2, mm), _mul_bf16x2(d3, mm)
    l0, h0 = _bf16_halves(d0, F32)
    l1, h1 = _bf16_halves(d1, F32)
    l2, h2 = _bf16_halves(d2, F32)
    l3, h3 = _bf16_halves(d3, F32)
    x = tl.join(tl.join(tl.join(l0, l1), tl.join(l2, l3)), tl.join(tl.join(h0, h1), tl.join(h2, h3)))
    x = x.reshape(BLOCK_N, 4, 4, 2, 2, 2)  # [i, t, w', j0, j1, p]: word c = 4 t + w'
    if F32:  # 2^(b - 127) and 2^126 as fp32
        m = tl.where(sc == 0, 0x00400000, sc << 23).to(tl.float32, bitcast=True)
        x = x * 8.507059173023462e37 * m.reshape(BLOCK_N, 1, 4, 1, 1, 1)
    R: tl.constexpr = BLOCK_N // (8 * NW)
    x = x.reshape(R, NW, 8, 4, 4, 2, 2, 2).permute(1, 0, 2, 4, 6, 5, 3, 7)  # [w, r, g | w', j1, j0, t, p]
    return x.reshape(BLOCK_N, _CHUNK)  # bf16 (fp32 under F32: the interpreter's bf16 dot misreads a permuted tile)


@triton.jit
def _tile_rows(pid_n, BLOCK_N: tl.constexpr, NW: tl.constexpr):
    """The weight row each tile row i = 8 NW r + 8 w + g reads: 8 R w + 8 r + g past the tile's first."""
    R: tl.constexpr = BLOCK_N // (8 * NW)
    i = tl.arange(0, BLOCK_N)
    return pid_n * BLOCK_N + 8 * R * ((i // 8) % NW) + 8 * (i // (8 * NW)) + i % 8


@triton.jit
def _tile_ptrs(W, WS, e, pid_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N: tl.constexpr,
               NW: tl.constexpr):
    """Expert e's first K chunk of the tile's rows (_tile_rows) in the tiled layout (repack_fragment,
    repack_scales): (BLOCK_N, 16) int32 words, (BLOCK_N, 4) scale bytes. A chunk later: _TILE_WORDS and
    _TILE_SCALES on."""
    rows = _tile_rows(pid_n, BLOCK_N, NW).to(tl.int64)
    block, r = rows // _TILE_ROWS, rows % _TILE_ROWS
    w_ptrs = W + e * stride_we + (block * _TILE_ROWS * stride_wn + r * 16)[:, None] + tl.arange(0, 16)[None, :]
    s_ptrs = WS + e * stride_se + (block * _TILE_ROWS * stride_sn + r * 4)[:, None] + tl.arange(0, 4)[None, :]
    return w_ptrs, s_ptrs


@triton.jit
def _scales(s_ptrs, k0, K, AHEAD: tl.constexpr):
    """The scale bytes of the chunk at k0 (s_ptrs its): AHEAD, those of the next chunk (zero past the last)."""
    if AHEAD:
        return tl.load(s_ptrs + _TILE_SCALES, mask=(k0 + _CHUNK + tl.zeros([1, 1], tl.int32)) < K, other=0)
    return tl.load(s_ptrs)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_frag(X, W, WS, H, SortedPairs, BlockExpert, NumPadded, num_pairs, top_k, N, K, limit,
                  stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_hm,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_PAIR: tl.constexpr, NW: tl.constexpr,
                  FAST: tl.constexpr, AHEAD: tl.constexpr, F32: tl.constexpr):
    """h[pair, n] = clamped SwiGLU of gate / up rows n (W rows n and N + n; strides in int32 words)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        tok = (pair // top_k).to(tl.int64)
        a_ptrs = X + tok[None, :] * stride_xm + tl.arange(0, _CHUNK)[:, None]  # (128, BLOCK_M)
        g_ptrs, gs_ptrs = _tile_ptrs(W, WS, e, pid_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N, NW)
        u_ptrs = g_ptrs + N * stride_wn  # N rows on: N / TILE_ROWS row blocks
        us_ptrs = gs_ptrs + N * stride_sn
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        gs = tl.load(gs_ptrs) if AHEAD else tl.zeros([BLOCK_N, 4], tl.uint8)
        us = tl.load(us_ptrs) if AHEAD else tl.zeros([BLOCK_N, 4], tl.uint8)
        for k0 in range(0, K, _CHUNK):
            a = tl.load(a_ptrs, mask=mmask[None, :], other=0.0).to(tl.float32 if F32 else tl.bfloat16)
            gs_next, us_next = _scales(gs_ptrs, k0, K, AHEAD), _scales(us_ptrs, k0, K, AHEAD)
            acc_g = tl.dot(_frag_tile(g_ptrs, gs if AHEAD else gs_next, BLOCK_N, NW, FAST, F32), a, acc_g)
            acc_u = tl.dot(_frag_tile(u_ptrs, us if AHEAD else us_next, BLOCK_N, NW, FAST, F32), a, acc_u)
            gs, us = gs_next, us_next
            a_ptrs += _CHUNK
            g_ptrs += _TILE_WORDS
            u_ptrs += _TILE_WORDS
            gs_ptrs += _TILE_SCALES
            us_ptrs += _TILE_SCALES
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        store_swiglu(H, pair, offs_n, mmask, offs_n < N, tl.trans(acc_g), tl.trans(acc_u), limit, stride_hm)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_frag(A, W, WS, Y, TopkWeights, SortedPairs, BlockExpert, NumPadded, num_pairs, N, K,
               stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_PAIR: tl.constexpr, NW: tl.constexpr,
               FAST: tl.constexpr, AHEAD: tl.constexpr, F32: tl.constexpr):
    """y[pair, n] = top-k weight x (h[pair] . W row n)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pair, e, valid = pair_rows(SortedPairs, BlockExpert, NumPadded, pid_m, num_pairs, BLOCK_M, PER_PAIR)
    if valid:
        mmask = pair < num_pairs
        pair64 = pair.to(tl.int64)
        a_ptrs = A + pair64[None, :] * stride_am + tl.arange(0, _CHUNK)[:, None]
        w_ptrs, s_ptrs = _tile_ptrs(W, WS, e, pid_n, stride_we, stride_wn, stride_se, stride_sn, BLOCK_N, NW)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        sc = tl.load(s_ptrs) if AHEAD else tl.zeros([BLOCK_N, 4], tl.uint8)
        for k0 in range(0, K, _CHUNK):
            a = tl.load(a_ptrs, mask=mmask[None, :], other=0.0).to(tl.float32 if F32 else tl.bfloat16)
            sc_next = _scales(s_ptrs, k0, K, AHEAD)
            acc = tl.dot(_frag_tile(w_ptrs, sc if AHEAD else sc_next, BLOCK_N, NW, FAST, F32), a, acc)
            sc = sc_next
            a_ptrs += _CHUNK
            w_ptrs += _TILE_WORDS
            s_ptrs += _TILE_SCALES
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        store_weighted(Y, TopkWeights, pair64, offs_n, mmask, offs_n < N, tl.trans(acc), stride_ym)


def fused_moe_mxfp4_frag(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                         down_scale: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         swiglu_limit: float | None = None, fast: bool = True,
                         config: dict | None = None) -> torch.Tensor:
    """fused_moe_mxfp4 over experts repacked by repack_fragment and their scales by repack_scales (same shapes;
    uint8 / e8m0 scales). fast: every scale byte <= FAST_MAX_SCALE (fast_scales; a larger one would decode to inf).
    config: BLOCK_N (a multiple of 16 num_warps and of TILE_ROWS), num_warps, num_stages, optionally AHEAD (default:
    at 64-row tiles) and BLOCK_M (pairs a row block, past PER_PAIR_MAX pairs; default 16 below
    SMALL_BLOCK_PAIRS_PER_EXPERT pairs an expert, else fused_moe's rule); None, or only BLOCK_M: _frag_tiles
    (FRAG_TILE_TABLE)."""
    t, k = ids.shape
    hidden = x.shape[1]
    inter = check_mxfp4_experts(gate_up, gate_up_scale, down, down_scale, hidden)
    gate_up_scale, down_scale = _as_bytes(gate_up_scale, "gate_up_scale"), _as_bytes(down_scale, "down_scale")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fused_moe_mxfp4_frag takes bf16 activations, got {x.dtype}")
    if not all(a.is_contiguous() for a in (x, gate_up, down, gate_up_scale, down_scale)):
        raise ValueError("fused_moe_mxfp4_frag needs contiguous x, expert weights and scales")
    e = gate_up.shape[0]
    num_pairs = t * k
    config = dict(config or {})
    block_m = config.pop("BLOCK_M", None) or _block_m(num_pairs, e)
    blocks = pair_blocks(ids, e, block_m) if block_m and num_pairs > PER_PAIR_MAX else pair_blocks(ids, e)
    config = config or _frag_tiles(num_pairs, blocks.block_m)
    block_n, nw = config.pop("BLOCK_N"), config["num_warps"]
    config.setdefault("AHEAD", block_n == TILE_ROWS)
    if block_n % (16 * nw) or block_n % TILE_ROWS or not (fragment_supported(inter, hidden, block_n)
                                   and fragment_supported(hidden, inter, block_n)):
        raise ValueError(f"fused_moe_mxfp4_frag: hidden {hidden} and expert width {inter} must be multiples of "
                         f"{CHUNK} and of BLOCK_N {block_n}, itself a multiple of 16 x num_warps ({nw}) and of "
                         f"{TILE_ROWS}")
    limit = float("inf") if swiglu_limit is None else float(swiglu_limit)
    h = x.new_empty(num_pairs, inter)
    y = x.new_empty(num_pairs, hidden)
    common = dict(BLOCK_M=blocks.block_m, BLOCK_N=block_n, PER_PAIR=blocks.per_pair, NW=nw, FAST=bool(fast),
                  F32=os.environ.get("TRITON_INTERPRET") == "1",
                  **config)
    gu, dn = gate_up.view(torch.int32), down.view(torch.int32)
    _gate_up_frag[(blocks.num_blocks, inter // block_n)](
        x, gu, gate_up_scale, h, *blocks.tensors, num_pairs, k, inter, hidden, limit,
        x.stride(0), gu.stride(0), gu.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0),
        **common)
    _down_frag[(blocks.num_blocks, hidden // block_n)](
        h, dn, down_scale, y, weights.flatten().float().contiguous(), *blocks.tensors, num_pairs, hidden, inter,
        h.stride(0), dn.stride(0), dn.stride(1), down_scale.stride(0), down_scale.stride(1), y.stride(0),
        **common)
    return combine_slots(y, t, k, hidden)
