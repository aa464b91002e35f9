"""A few rows times a dense weight with the work around it fused in: the residual add and RMSNorm before, SiLU-and-mul
after. For a decode step of a small model, where each layer's kernels are short and the step is bound by how many
run one after another (SmolLM2 at 32K, batch 1: ten launches a layer of 1-4 us each around a 10 us attention), not by
the bytes they read.

    row_gemv(x, w)                                    x @ w.T
    row_gemv(x, w, norm_weight=nw, eps=e)             norm(x) @ w.T
    row_gemv(x, w, residual=r, norm_weight=nw, ...)   (norm(x + r) @ w.T, x + r)
    row_gemv(..., silu_mul=True)                      silu(h @ w[:I].T) * (h @ w[I:].T), w = [gate | up] (2I, K)

Each program owns BLOCK_N output columns (with silu_mul, the same columns of the gate and of the up half) for every
row and walks K in BLOCK_K steps (one step where K <= 1024), each
weight tile loaded before the rows' arithmetic and multiplied by every row on the CUDA cores, fp32 products and
sums. With a norm and K in one step the row is loaded, normalized and multiplied at once; over several steps a
first pass sums each row's squares. Every program recomputes the rows' sums (a row is a few KB); program 0 alone
writes x + r. Roundings follow the module path (reference.rms_norm, silu_and_mul): the sum x + r, x / rms(x), the
weighted norm, the products before SiLU and SiLU itself are each rounded to the model dtype; the sums run in
another order than cuBLAS's, so results equal the module path's within the last bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

MAX_ROWS = 4
"""Rows one launch takes. The products run on the CUDA cores (each weight tile times every row, in registers); a
16-row tensor-core tile was measured at 6.1 us a launch on an H100 against cuBLAS's 3.6-4 (SmolLM2's shapes)."""


@triton.jit
def _row_tile(X, R, offs_m, offs_k, mmask, kmask, stride_x, stride_r, HAS_RES: tl.constexpr):
    """Rows offs_m, columns offs_k of x (+ r, rounded to x's dtype), 0 outside."""
    mask = mmask[:, None] & kmask[None, :]
    x = tl.load(X + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RES:
        x = (x + tl.load(R + offs_m[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)).to(
            X.dtype.element_ty)
    return x


@triton.jit
def _products(X, R, NW, ResOut, W1, W2, T, K, stride_x, stride_r, stride_ro, eps, nmask,
              HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, TWO: tl.constexpr, ONE_PASS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """(acc1, acc2) (BLOCK_M, BLOCK_N) fp32: the rows (normalized, + r) times the weight rows at W1 (and at W2 when
    TWO; else acc2 is acc1), W1 / W2 (BLOCK_N, 1) pointers to the rows' first columns. Program 0 writes x + r.
    PDL (a programmatic dependent launch): the first weight tile is read before waiting for the kernel before to
    finish (weights are never written), everything else after."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < T
    offs_k = tl.arange(0, BLOCK_K)
    wmask = nmask[:, None] & (offs_k < K)[None, :]
    w1 = tl.load(W1 + offs_k[None, :], mask=wmask, other=0.0)  # issued before the rows' arithmetic
    w2 = tl.load(W2 + offs_k[None, :], mask=wmask, other=0.0) if TWO else w1
    pdl_wait(PDL)  # the rows (and every buffer this launch writes) are the kernel before's
    if HAS_NORM and not ONE_PASS:  # the rows' sums of squares first, over K in tiles
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            x = _row_tile(X, R, offs_m, offs_k, mmask, kmask, stride_x, stride_r, HAS_RES)
            if HAS_RES:
                if pid == 0:
                    tl.store(ResOut + offs_m[:, None] * stride_ro + offs_k[None, :], x,
                             mask=mmask[:, None] & kmask[None, :])
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, 1)
        inv = tl.rsqrt(ss / K + eps)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        if k0 > 0:  # the first tile came before the loop
            wmask = nmask[:, None] & kmask[None, :]
            w1 = tl.load(W1 + offs_k[None, :], mask=wmask, other=0.0)
            if TWO:
                w2 = tl.load(W2 + offs_k[None, :], mask=wmask, other=0.0)
        x = _row_tile(X, R, offs_m, offs_k, mmask, kmask, stride_x, stride_r, HAS_RES and HAS_NORM)
        if HAS_NORM:
            if ONE_PASS:  # BLOCK_K >= K: this tile is the whole row
                if HAS_RES:
                    if pid == 0:
                        tl.store(ResOut + offs_m[:, None] * stride_ro + offs_k[None, :], x,
                                 mask=mmask[:, None] & kmask[None, :])
                xf = x.to(tl.float32)
                inv = tl.rsqrt(tl.sum(xf * xf, 1) / K + eps)
            xn = (x.to(tl.float32) * inv[:, None]).to(x.dtype).to(tl.float32)
            nw = tl.load(NW + offs_k, mask=kmask, other=0.0).to(tl.float32)
            x = (nw[None, :] * xn).to(W1.dtype.element_ty)
        xf = x.to(tl.float32)[:, None, :]
        acc1 += tl.sum(xf * w1.to(tl.float32)[None, :, :], 2)
        if TWO:
            acc2 += tl.sum(xf * w2.to(tl.float32)[None, :, :], 2)
    if TWO:
        return acc1, acc2
    return acc1, acc1


@triton.jit
def _row_gemv_kernel(X, R, NW, W, Y, ResOut, T, N, K, stride_x, stride_r, stride_w, stride_y, stride_ro, up_offset,
                     eps, HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, SILU: tl.constexpr, ONE_PASS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_w
    acc, acc_up = _products(X, R, NW, ResOut, w_rows, w_rows + up_offset, T, K, stride_x, stride_r, stride_ro, eps,
                            nmask, HAS_RES, HAS_NORM, SILU, ONE_PASS, BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    out = acc.to(Y.dtype.element_ty)
    if SILU:
        g = out.to(tl.float32)
        out = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty) * acc_up.to(Y.dtype.element_ty)
    tl.store(Y + offs_m[:, None] * stride_y + offs_n[None, :], out, mask=(offs_m < T)[:, None] & nmask[None, :])


@triton.jit
def _qkv_rope_store_kernel(X, R, NW, W, Q, ResOut, Positions, Cos, Sin, KBuf, VBuf, Slots, T, K, stride_x, stride_r,
                           stride_w, stride_q, stride_ro, stride_kb, stride_vb, num_q_heads, num_kv_heads, eps,
                           HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, ONE_PASS: tl.constexpr,
                           INTERLEAVE: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_N rotary pairs a program: pair p is (head p // HALF, j = p % HALF), the QKV outputs (j, j + HALF) of
    its head (INTERLEAVE: (2j, 2j + 1)). q and k pairs rotate by their token's cos / sin (elementwise._rotated's
    arithmetic on the products rounded to the model dtype), written half-split: q to Q (T, Hq, 2 HALF), k to the
    pool row of the token's slot; v pairs go to the pool at their own columns; slots < 0 (padding) store no K/V."""
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < T
    pairs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    num_heads = num_q_heads + 2 * num_kv_heads
    nmask = pairs < num_heads * HALF
    head, j = pairs // HALF, pairs % HALF
    col1 = head * (2 * HALF) + (2 * j if INTERLEAVE else j)
    col2 = col1 + (1 if INTERLEAVE else HALF)
    a, b = _products(X, R, NW, ResOut, W + col1.to(tl.int64)[:, None] * stride_w,
                     W + col2.to(tl.int64)[:, None] * stride_w, T, K, stride_x, stride_r, stride_ro, eps, nmask,
                     HAS_RES, HAS_NORM, True, ONE_PASS, BLOCK_M, BLOCK_N, BLOCK_K, PDL)
    a = a.to(Q.dtype.element_ty).to(tl.float32)  # the QKV product as the module path rounds it
    b = b.to(Q.dtype.element_ty).to(tl.float32)
    pos = tl.load(Positions + offs_m, mask=mmask, other=0).to(tl.int64)
    cos = tl.load(Cos + pos[:, None] * HALF + j[None, :], mask=mmask[:, None] & nmask[None, :], other=0.0)
    sin = tl.load(Sin + pos[:, None] * HALF + j[None, :], mask=mmask[:, None] & nmask[None, :], other=0.0)
    r1 = (a * cos - b * sin).to(Q.dtype.element_ty)
    r2 = (b * cos + a * sin).to(Q.dtype.element_ty)
    is_q = (head < num_q_heads)[None, :] & nmask[None, :] & mmask[:, None]
    qdst = Q + offs_m[:, None] * stride_q + (head * (2 * HALF) + j)[None, :]
    tl.store(qdst, r1, mask=is_q)
    tl.store(qdst + HALF, r2, mask=is_q)
    slot = tl.load(Slots + offs_m, mask=mmask, other=-1).to(tl.int64)
    kv_row = mmask & (slot >= 0)
    is_k = (head >= num_q_heads) & (head < num_q_heads + num_kv_heads) & nmask
    kdst = KBuf + slot[:, None] * stride_kb + ((head - num_q_heads) * (2 * HALF) + j)[None, :]
    tl.store(kdst, r1.to(KBuf.dtype.element_ty), mask=kv_row[:, None] & is_k[None, :])
    tl.store(kdst + HALF, r2.to(KBuf.dtype.element_ty), mask=kv_row[:, None] & is_k[None, :])
    is_v = (head >= num_q_heads + num_kv_heads) & nmask
    v_cols = (head - num_q_heads - num_kv_heads) * (2 * HALF) + col1 % (2 * HALF)
    vdst = VBuf + slot[:, None] * stride_vb + v_cols[None, :]
    tl.store(vdst, a.to(VBuf.dtype.element_ty), mask=kv_row[:, None] & is_v[None, :])
    tl.store(vdst + (col2 - col1)[None, :], b.to(VBuf.dtype.element_ty), mask=kv_row[:, None] & is_v[None, :])


def tiles_for(t: int, n: int, k: int) -> dict:
    """Launch shape for t rows of x (t, k) and n outputs: 4 output columns a program (2 past K = 1024), so that a
    small model's 576-1536 outputs spread over 140-290 programs, and K in tiles of up to 1024. On an H100
    (benchmark/bench_row_gemv.py, results/gpu_row_gemv_h100.json: SmolLM2's four products at 1 and 4 rows, 24
    tiles each) this rule is within 0.2 us of the best tile of every product."""
    return dict(BLOCK_M=triton.next_power_of_2(t), BLOCK_N=4 if k <= 1024 else 2,
                BLOCK_K=min(triton.next_power_of_2(max(k, 16)), 1024), num_warps=4)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether row_gemv takes these x (T, K) and weight (N, K)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and weight.dim() == 2
            and weight.stride(1) == 1 and weight.dtype == x.dtype and weight.shape[1] == x.shape[1]
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.shape[1] >= 16)


def _rows_in(name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
             norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The inputs both wrappers take, checked: (the residual or x in its place, a buffer for x + residual or None)."""
    if not supports(x, weight):
        raise ValueError(f"{name} takes 1..{MAX_ROWS} rows of unit column stride and a weight of their dtype and "
                         f"width; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if residual is None:
        return x, None
    if norm_weight is None:
        raise ValueError(f"{name} adds a residual only before a norm")
    if residual.shape != x.shape or residual.stride(1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
    return residual, torch.empty_like(x)


def row_gemv(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
             config: dict | None = None, pdl: bool = False):
    """See the module doc. x (T, K) with T <= MAX_ROWS and weight (N, K), both with unit column stride and one dtype.
    Returns y (T, N), or (T, N / 2) with silu_mul; with a residual, (y, x + residual). pdl: launched as a
    programmatic dependent launch (CUDA, SM90+; dispatch.pdl_launch)."""
    r, res_out = _rows_in("row_gemv", x, weight, residual, norm_weight)
    t, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    y = x.new_empty(t, n)
    res_out = y if res_out is None else res_out
    cfg = dict(tiles_for(t, n, k), **(config or {}))
    _row_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, r, norm_weight if norm_weight is not None else weight, weight, y, res_out, t, n, k, x.stride(0),
        r.stride(0), weight.stride(0), y.stride(0), res_out.stride(0), n * weight.stride(0), eps,
        HAS_RES=residual is not None, HAS_NORM=norm_weight is not None, SILU=silu_mul, ONE_PASS=cfg["BLOCK_K"] >= k,
        **cfg, **pdl_launch(pdl))
    return (y, res_out) if residual is not None else y


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, interleave: bool, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   slots: torch.Tensor, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0, config: dict | None = None, pdl: bool = False):
    """A Llama layer's QKV product with what follows it up to attention, in one launch: h = norm(x (+ residual)),
    qkv = h @ weight.T (weight (Hq + 2 Hkv) D x K), q and k rotated by their positions' rows of the (max_position,
    D/2) fp32 tables, k and v stored at k_buf / v_buf[slots[t]] (slots < 0: none). The arithmetic of row_gemv then
    elementwise.gqa_rope_store. Returns q (T, Hq, D), and with a residual (q, x + residual)."""
    r, res_out = _rows_in("qkv_rope_store", x, weight, residual, norm_weight)
    t, k = x.shape
    heads = num_q_heads + 2 * num_kv_heads
    d = weight.shape[0] // heads
    if d * heads != weight.shape[0] or d & (d - 1) or any(b.shape[1:] != (num_kv_heads, d) or not b[0].is_contiguous()
                                                         for b in (k_buf, v_buf)):
        raise ValueError("qkv_rope_store needs power-of-two heads and pool rows of the KV heads")
    q = x.new_empty(t, num_q_heads, d)
    res_out = q if res_out is None else res_out
    cfg = dict(tiles_for(t, heads * d // 2, k), **(config or {}))
    _qkv_rope_store_kernel[(triton.cdiv(heads * d // 2, cfg["BLOCK_N"]),)](
        x, r, norm_weight if norm_weight is not None else weight, weight, q,
        res_out, positions, cos, sin, k_buf, v_buf, slots, t, k, x.stride(0),
        r.stride(0), weight.stride(0), q.stride(0), res_out.stride(0),
        k_buf.stride(0), v_buf.stride(0), num_q_heads, num_kv_heads, eps, HAS_RES=residual is not None,
        HAS_NORM=norm_weight is not None, ONE_PASS=cfg["BLOCK_K"] >= k, INTERLEAVE=interleave, HALF=d // 2, **cfg,
        **pdl_launch(pdl))
    return (q, res_out) if residual is not None else q
