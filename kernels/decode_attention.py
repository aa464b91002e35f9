"""Paged decode attention (one query per sequence) in Triton, for GQA and absorbed MLA.

Each sequence's KV is found through a page table: position j of row b lives in slot
`page_table[table_rows[b], j // page_size] * page_size + j % page_size` of the layer's K/V buffers.

One program handles one (sequence, KV head, split): all the query heads of that KV head (GQA group, or all
heads for MLA, whose single latent KV head is shared) against one contiguous chunk of the sequence, so each
KV entry is read once per step. Splits (flash-decoding) give small batches enough programs to fill the GPU;
a second kernel merges the splits by their log-sum-exp. K's columns come as a power-of-two head part
(latent, or the whole head) plus an optional power-of-two tail (MLA's rope part); MLA's V is K's head part,
so it is reused from registers instead of being loaded again. Empty rows (seq_len 0, CUDA-graph padding)
yield zeros.

Fixed-split mode (`paged_decode_attention_fixed`, batch-invariant attention): the default mode picks the split
count and tile size from the batch size, which moves a row's split points and so its rounding. Here split s
of every row covers absolute positions [s * FIXED_SPLIT_SIZE, (s + 1) * FIXED_SPLIT_SIZE), tiles and warps
depend on the head dims only, and a second kernel merges the row's own splits one after another in ascending
order. The grid's split count only has to cover the longest row (programs past a row's end do nothing), so a
CUDA graph captures the count of its longest context.

FP8 KV (the pool's kv_cache_dtype 'fp8_e4m3'): K/V come as float8_e4m3fn rows with one float32 scale per (slot,
KV head) in `k_scale` / `v_scale` (slots, Hkv). The kernels read them as they are: a tile is converted to the
query's dtype exactly (every e4m3 value is a bf16/fp16/fp32 value), K's scales multiply the tile's scores and
V's scales the probabilities before p.V, with fp32 accumulation; the dequantized rows are never built.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait
from deepinfer_kernels.reference import paged_decode_attention_ref  # noqa: F401 (the kernels' reference, here too)


@triton.jit
def _attend_range(Q, QT, K, V, KS, VS, PageTable, b, kvh, head0, row, start, end, stride_qb, stride_qh, stride_qtb,
                  stride_qth, stride_kn, stride_kh, stride_vn, stride_vh, stride_ks, stride_vs, stride_pt, sm_scale,
                  page_size, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                  DK: tl.constexpr, DT: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
                  V_IS_K: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr, F16_DOT: tl.constexpr):
    """Query heads head0 .. head0 + BLOCK_H of KV head `kvh`'s group, row b, over positions [start, end), in
    BLOCK_N-token tiles from `start`: (normalised output (BLOCK_H, DV) fp32, base-2 log-sum-exp (BLOCK_H,), -inf
    when empty)."""
    offs_h = head0 + tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    hmask = offs_h < GROUP
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :], mask=hmask[:, None], other=0.0)
    if F16_DOT:  # fp8 tiles convert to fp16 in one instruction per two values; the query joins them
        q = q.to(tl.float16)
    if DT > 0:
        offs_dt = tl.arange(0, DT)
        q_t = tl.load(QT + b * stride_qtb + heads[:, None] * stride_qth + offs_dt[None, :], mask=hmask[:, None],
                      other=0.0)
        if F16_DOT:
            q_t = q_t.to(tl.float16)
    qk_scale = sm_scale * 1.4426950408889634  # exp2 below

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(PageTable + row * stride_pt + offs_n // page_size, mask=nmask, other=0).to(tl.int64)
        slot = page * page_size + offs_n % page_size
        k_base = K + slot[:, None] * stride_kn + kvh * stride_kh
        k = tl.load(k_base + offs_dk[None, :], mask=nmask[:, None], other=0.0)  # (N, DK)
        if KV_FP8:  # exact conversion; the row scales apply to the scores below
            k = k.to(q.dtype)
        if IEEE:  # fp32 caches: full fp32 products (TF32 would drift from the CPU reference)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        if DT > 0:
            k_t = tl.load(k_base + DK + offs_dt[None, :], mask=nmask[:, None], other=0.0)
            if KV_FP8:
                k_t = k_t.to(q_t.dtype)
            if DT >= 16:
                if IEEE:
                    qk += tl.dot(q_t, tl.trans(k_t), input_precision="ieee")
                else:
                    qk += tl.dot(q_t, tl.trans(k_t))
            else:  # tl.dot needs K >= 16
                qk += tl.sum(q_t.to(tl.float32)[:, None, :] * k_t.to(tl.float32)[None, :, :], 2)
        if KV_FP8:
            qk = qk * tl.load(KS + slot * stride_ks + kvh, mask=nmask, other=0.0)[None, :]
        qk = tl.where(nmask[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K:
            v = k
        else:
            v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_dv[None, :], mask=nmask[:, None],
                        other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
        if KV_FP8:  # V's row scales weight the probabilities (l_i keeps the unscaled ones)
            p = p * tl.load(VS + slot * stride_vs + kvh, mask=nmask, other=0.0)[None, :]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    return out, lse


@triton.jit
def _store_split(PartO, PartLse, out, lse, b, kvh, head0, split, num_splits, GROUP: tl.constexpr,
                 BLOCK_H: tl.constexpr, DV: tl.constexpr, HEAD_BLOCKS: tl.constexpr):
    """A split's (BLOCK_H, DV) partial output and log-sum-exp at PartO / PartLse (B, Hq, num_splits[, DV])."""
    offs_h = head0 + tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    hmask = offs_h < GROUP
    offs_dv = tl.arange(0, DV)
    part = (b * (GROUP * (tl.num_programs(1) // HEAD_BLOCKS)) + heads) * num_splits + split
    tl.store(PartO + part[:, None] * DV + offs_dv[None, :], out, mask=hmask[:, None])
    tl.store(PartLse + part, lse, mask=hmask)


@triton.jit
def _decode_split_kernel(Q, QT, K, V, KS, VS, PageTable, TableRows, SeqLens, PartO, PartLse, O,
                         stride_qb, stride_qh, stride_qtb, stride_qth, stride_kn, stride_kh, stride_vn, stride_vh,
                         stride_ks, stride_vs, stride_pt, stride_ob, stride_oh,
                         sm_scale, page_size,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, DK: tl.constexpr, DT: tl.constexpr,
                         DV: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         V_IS_K: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
                         F16_DOT: tl.constexpr, HEAD_BLOCKS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # q and the step's K / V rows are the kernels' before
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS  # axis 1: a KV head's group of query heads, BLOCK_H at a time
    head0 = tl.program_id(1) % HEAD_BLOCKS * BLOCK_H
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    row = tl.load(TableRows + b).to(tl.int64)
    out, lse = _attend_range(Q, QT, K, V, KS, VS, PageTable, b, kvh, head0, row, start, end, stride_qb, stride_qh,
                             stride_qtb, stride_qth, stride_kn, stride_kh, stride_vn, stride_vh, stride_ks, stride_vs,
                             stride_pt, sm_scale, page_size, GROUP, BLOCK_H, DK, DT, DV, BLOCK_N, V_IS_K, IEEE, KV_FP8,
                             F16_DOT)
    if NUM_SPLITS == 1:  # the output itself (what the merge of one split would store, bit for bit)
        offs_h = head0 + tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_h
        offs_dv = tl.arange(0, DV)
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :], out.to(O.dtype.element_ty),
                 mask=(offs_h < GROUP)[:, None])
    else:
        _store_split(PartO, PartLse, out, lse, b, kvh, head0, split, NUM_SPLITS, GROUP, BLOCK_H, DV, HEAD_BLOCKS)


@triton.jit
def _fixed_split_kernel(Q, QT, K, V, KS, VS, PageTable, TableRows, SeqLens, PartO, PartLse,
                        stride_qb, stride_qh, stride_qtb, stride_qth, stride_kn, stride_kh, stride_vn, stride_vh,
                        stride_ks, stride_vs, stride_pt,
                        sm_scale, page_size, num_splits,
                        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, DK: tl.constexpr, DT: tl.constexpr,
                        DV: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_SIZE: tl.constexpr,
                        V_IS_K: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
                        F16_DOT: tl.constexpr, HEAD_BLOCKS: tl.constexpr):
    """Split s covers absolute positions [s * SPLIT_SIZE, (s + 1) * SPLIT_SIZE); splits past the row's KV
    write nothing (the merge reads only the row's own splits)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    head0 = tl.program_id(1) % HEAD_BLOCKS * BLOCK_H
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    start = split * SPLIT_SIZE
    if start < seq_len:
        end = tl.minimum(start + SPLIT_SIZE, seq_len)
        row = tl.load(TableRows + b).to(tl.int64)
        out, lse = _attend_range(Q, QT, K, V, KS, VS, PageTable, b, kvh, head0, row, start, end, stride_qb, stride_qh,
                                 stride_qtb, stride_qth, stride_kn, stride_kh, stride_vn, stride_vh, stride_ks,
                                 stride_vs, stride_pt, sm_scale, page_size, GROUP, BLOCK_H, DK, DT, DV, BLOCK_N,
                                 V_IS_K, IEEE, KV_FP8, F16_DOT)
        _store_split(PartO, PartLse, out, lse, b, kvh, head0, split, num_splits, GROUP, BLOCK_H, DV, HEAD_BLOCKS)


@triton.jit
def _merge_columns(PartO, PartLse, O, b, h, d0, num_heads, stride_ob, stride_oh, NUM_SPLITS: tl.constexpr,
                   BLOCK_S: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head h of row b, output columns d0 .. d0 + BLOCK_D: the splits' partial outputs weighted by their
    log-sum-exp."""
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < NUM_SPLITS
    base = (b * num_heads + h) * NUM_SPLITS
    lse = tl.load(PartLse + base + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    offs_d = d0 + tl.arange(0, BLOCK_D)
    dmask = offs_d < DV
    # Empty splits (past a short row's end: the grid is sized for long ones) are never read.
    full = smask & (lse > float("-inf"))
    ptrs = PartO + (base + offs_s)[:, None] * DV + offs_d[None, :]
    parts = tl.load(ptrs, mask=full[:, None] & dmask[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=dmask)


@triton.jit
def _merge_splits_kernel(PartO, PartLse, O, stride_ob, stride_oh, NUM_HEADS: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr):
    """One (row, head, BLOCK_D output columns) per program. The columns are split over programs so that a
    program's tile (BLOCK_S x BLOCK_D fp32) stays in registers: MLA at batch 1 merges up to 128 splits of 512
    columns, which as one tile per head spilled and ran one program per head (16 of the GPU's 132
    multiprocessors)."""
    pdl_wait(PDL)
    _merge_columns(PartO, PartLse, O, tl.program_id(0), tl.program_id(1), tl.program_id(2) * BLOCK_D, NUM_HEADS,
                   stride_ob, stride_oh, NUM_SPLITS, BLOCK_S, DV, BLOCK_D)


MERGE_TILE = 4096
"""fp32 values of partial outputs one merge program holds (BLOCK_S x BLOCK_D): 32 a thread at 4 warps."""


def merge_block_d(num_splits: int, dv: int) -> int:
    """The merge's output columns per program: as many as keep its tile within MERGE_TILE, at least 16."""
    block_s = max(2, triton.next_power_of_2(num_splits))
    return max(16, min(triton.next_power_of_2(dv), MERGE_TILE // block_s))


@triton.jit
def _merge_fixed_splits_kernel(PartO, PartLse, SeqLens, O, stride_ob, stride_oh, num_splits,
                               NUM_HEADS: tl.constexpr, SPLIT_SIZE: tl.constexpr, DV: tl.constexpr):
    """Online merge of the row's own splits 0 .. cdiv(seq_len, SPLIT_SIZE) - 1 in ascending order: the same
    operations whatever the grid's split count (a vector reduction over the splits would change with it)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    base = (b * NUM_HEADS + h) * num_splits
    offs_d = tl.arange(0, DV)
    m = float("-inf")
    total = 0.0
    acc = tl.zeros([DV], tl.float32)
    for s in range(0, tl.cdiv(seq_len, SPLIT_SIZE)):
        lse = tl.load(PartLse + base + s)  # finite: every split before seq_len holds at least one key
        part = tl.load(PartO + (base + s) * DV + offs_d)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha + part * w
        total = total * alpha + w
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)  # seq_len 0: zeros
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


def _split_head_dim(dk: int, dv: int) -> tuple[int, int]:
    """K columns as (power-of-two head part, power-of-two tail or 0); the head part covers V's columns."""
    head = triton.next_power_of_2(dv)
    if head > dk:
        raise ValueError(f"decode attention: V dim {dv} exceeds K dim {dk}")
    tail = dk - head
    if head != dv or (tail and triton.next_power_of_2(tail) != tail):
        raise ValueError(f"decode attention: unsupported head dims qk={dk}, v={dv}")
    return head, tail


def num_splits_for(batch: int, kv_heads: int, num_sms: int, head_dim: int = 0) -> int:
    """Splits per (sequence, KV head). Measured on an H200 at 2K context (benchmark/bench_kernels.py,
    benchmark/bench_gpu.py's step profiles):
      * MLA (head_dim > 256: 16 heads over the 576-wide latent per program) is fastest at about two programs
        per multiprocessor, rounded down to a power of two, up to 64: 64 / 16 / 4 / 1 splits at batch
        1 / 16 / 64 / 256; rounding up doubles them and costs 20-45% at batch 16-64.
      * GQA programs are light (a few heads of 64-128 dims): about four programs per multiprocessor, rounded
        up (bench_kernels.py --only decode_sweep, SmolLM2's shape, 3-stage pipeline): 16 / 4 / 1
        splits at batch 16 / 64 / 256, 9.7 / 31.4 / 100.3 us against 10.0 / 43.7 / 107.2 us for the earlier
        two-per-multiprocessor rule with a 2-stage pipeline. Up to 256 GQA splits: at 32K tokens a lone request
        (SmolLM2, 3 KV heads) read its KV at 0.45 of the copy rate with the former cap of 32 and at 0.81 with 256
        (H100, bench_kernels.py --only decode_sweep --context 32768); at batch 4 the rule's 64 splits are 0.83.
    Up to 128 MLA splits at batch 1, so that one long request fills the GPU (64 programs left half of an H200's
    132 multiprocessors idle at 32K tokens). A split is never shorter than a tile (`_decode_split_kernel` rounds
    its chunk up to one): a short row uses fewer splits than the grid holds, the rest end at once and the merge
    skips them, so at 2K tokens batch 1 still runs 64 splits of 32 tokens."""
    if head_dim > 256:
        want = 2 * num_sms / max(1, batch * kv_heads)
        return min(128, 1 << (max(1, int(want)).bit_length() - 1))
    want = 4 * num_sms / max(1, batch * kv_heads)
    return max(1, min(256, triton.next_power_of_2(math.ceil(want))))


def _query_tail(q: torch.Tensor, q_tail: torch.Tensor | None, dk: int, dv: int) -> torch.Tensor:
    """The query's tail columns (MLA's rope part; empty for GQA). They may come apart from q, which then holds
    only the head part: the caller spares a concatenation."""
    head = _split_head_dim(dk, dv)[0]
    width = q.shape[-1] + (0 if q_tail is None else q_tail.shape[-1])
    if width != dk or (q_tail is not None and (q.shape[-1] != head or q_tail.stride(-1) != 1)):
        raise ValueError(f"decode attention: a query of {width} columns (head part {q.shape[-1]}) for keys of {dk}")
    return q[..., head:] if q_tail is None else q_tail


MLA_BLOCK_H, GQA_BLOCK_H = 16, 64
"""Query heads one program attends at most (a KV head's larger group spreads over HEAD_BLOCKS programs, axis 1 of
the grid, and the default kernel divides its split count by them, so the grid keeps about the programs
num_splits_for asked for): MLA's 576-column tiles at 16 heads are the tuned tile of V2-Lite's 16 heads;
DeepSeek-V3's 128 as one tile needed 288 KB of shared memory (an H100 has 227). Not timed at V3's heads yet."""


FP8_KV_DOTS = ("f16", "query")
"""The operand dtype of the dots over float8_e4m3fn K/V tiles: fp16 with a 16-bit query converted to it ('f16', the
default: e4m3 converts to fp16 in one instruction per two values, to bf16 through fp32; 12-15% faster than bf16
dots in benchmark/bench_kv8_decode.py on an H200), or the query's own dtype ('query')."""


def _layout(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_dot: str = "query") -> dict:
    """The kernels' shape constants for these buffers."""
    hq, dk = q.shape[1], k_buf.shape[-1]
    hkv, dv = k_buf.shape[1], v_buf.shape[-1]
    head, tail = _split_head_dim(dk, dv)
    fp8 = k_buf.dtype == torch.float8_e4m3fn
    group = hq // hkv
    block_h = min(max(16, triton.next_power_of_2(group)), MLA_BLOCK_H if dk > 256 else GQA_BLOCK_H)
    return dict(GROUP=group, BLOCK_H=block_h, HEAD_BLOCKS=triton.cdiv(group, block_h), DK=head, DT=tail, DV=dv,
                V_IS_K=v_buf.data_ptr() == k_buf.data_ptr() and v_buf.stride() == k_buf.stride(),
                IEEE=(q if fp8 else k_buf).dtype == torch.float32, KV_FP8=fp8,
                F16_DOT=fp8 and kv_dot == "f16" and q.dtype != torch.float32)


def _scales(k_buf: torch.Tensor, v_buf: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The row scales the kernels read with fp8 buffers (unused pointers, K's buffer, otherwise)."""
    fp8 = k_buf.dtype == torch.float8_e4m3fn
    if fp8 != (k_scale is not None) or (v_scale is None) != (k_scale is None) or v_buf.dtype != k_buf.dtype:
        raise ValueError("decode attention: float8_e4m3fn K/V buffers come with both k_scale and v_scale, "
                         "other buffers with neither")
    if not fp8:
        return k_buf, k_buf
    for name, s, buf in (("k_scale", k_scale, k_buf), ("v_scale", v_scale, v_buf)):
        if s.dtype != torch.float32 or s.shape != buf.shape[:2] or s.stride(1) != 1:
            raise ValueError(f"decode attention: {name} must be float32 (slots, heads) with unit head stride, got "
                             f"{tuple(s.shape)} {s.dtype}")
    return k_scale, v_scale


def paged_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, page_table: torch.Tensor,
                           table_rows: torch.Tensor, seq_lens: torch.Tensor, page_size: int, scale: float,
                           num_splits: int, out: torch.Tensor | None = None, block_n: int | None = None,
                           num_warps: int = 4, num_stages: int | None = None, q_tail: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           kv_dot: str = "f16", pdl: bool = False) -> torch.Tensor:
    """q (B, Hq, Dqk); k_buf (slots, Hkv, Dqk); v_buf (slots, Hkv, Dv), for MLA a column view of k_buf;
    page_table (R, W) int32 page ids; table_rows (B,) int32 row of each sequence; seq_lens (B,) int32.
    q_tail: the query's last columns apart (MLA's rope part), q then (B, Hq, Dv). k_scale / v_scale (slots, Hkv)
    float32: the row scales of float8_e4m3fn buffers (MLA: the same tensor); kv_dot: one of FP8_KV_DOTS; pdl: the
    kernels as programmatic dependent launches (CUDA, SM90+; dispatch.pdl_launch). Returns
    (B, Hq, Dv) in q's dtype."""
    if kv_dot not in FP8_KV_DOTS:
        raise ValueError(f"decode attention: kv_dot {kv_dot!r} is not one of {FP8_KV_DOTS}")
    bsz, hq, _ = q.shape
    hkv, dk, dv = k_buf.shape[1], k_buf.shape[-1], v_buf.shape[-1]
    q_tail = _query_tail(q, q_tail, dk, dv)
    layout = _layout(q, k_buf, v_buf, kv_dot)
    ks, vs = _scales(k_buf, v_buf, k_scale, v_scale)
    if out is None:
        out = q.new_empty(bsz, hq, dv)
    # num_splits_for counts programs per KV head; a group spread over head blocks has that many already.
    num_splits = max(1, num_splits // layout["HEAD_BLOCKS"])
    # One split writes the output itself: no partials, no merge launch.
    part_o = torch.empty(bsz, hq, num_splits, dv, dtype=torch.float32, device=q.device) if num_splits > 1 else out
    part_lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device) if num_splits > 1 else out
    # Measured on an H200 (MLA, 2K context): 64-token tiles are best from batch 16 up, 32-token tiles at batch 1;
    # float8 tiles, converted in registers, 32 at every batch (benchmark/bench_kv8_decode.py: 91 against 105 us at
    # batch 64, V2-Lite's heads, fp16 dots).
    block_n = block_n or (64 if (dk <= 256 or bsz >= 8) and not layout["KV_FP8"] else 32)
    # 3 stages for GQA's light 16-bit tiles (num_splits_for), 2 for MLA's 576-column ones (bench_kernels.py's
    # sweep) and for fp32 caches (shared memory).
    num_stages = num_stages or (3 if dk <= 256 and not layout["IEEE"] else 2)
    grid = (bsz, hkv * layout["HEAD_BLOCKS"], num_splits)
    _decode_split_kernel[grid](
        q, q_tail, k_buf, v_buf, ks, vs, page_table, table_rows, seq_lens, part_o, part_lse, out,
        q.stride(0), q.stride(1), q_tail.stride(0), q_tail.stride(1), k_buf.stride(0), k_buf.stride(1),
        v_buf.stride(0), v_buf.stride(1), ks.stride(0), vs.stride(0),
        page_table.stride(0), out.stride(0), out.stride(1), scale, page_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, **layout, num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl))
    if num_splits == 1:
        return out
    block_d = merge_block_d(num_splits, dv)
    _merge_splits_kernel[(bsz, hq, triton.cdiv(dv, block_d))](
        part_o, part_lse, out, out.stride(0), out.stride(1), NUM_HEADS=hq, NUM_SPLITS=num_splits,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), DV=dv, BLOCK_D=block_d, num_warps=4,
        **pdl_launch(pdl))
    return out


FIXED_SPLIT_SIZE = 256
"""Tokens per split in the fixed-split mode (a multiple of the tile size)."""
FIXED_BLOCK_N = 64
"""Tokens per tile in the fixed-split mode; MLA's wide keys (576 columns) take half as many."""
_FIXED_PART_BYTES = 256 << 20
"""Bound on the fixed mode's fp32 split results per launch: more rows (prefill rows over a long context) run in
several launches, each row still computed alone."""


def fixed_num_splits(max_len: int) -> int:
    """The fixed mode's split count for KV lengths up to max_len."""
    return max(1, triton.cdiv(max_len, FIXED_SPLIT_SIZE))


def paged_decode_attention_fixed(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                                 page_table: torch.Tensor, table_rows: torch.Tensor, seq_lens: torch.Tensor,
                                 page_size: int, scale: float, num_splits: int,
                                 out: torch.Tensor | None = None, q_tail: torch.Tensor | None = None,
                                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """paged_decode_attention with every numerical choice fixed by the model, never by the batch: split s of a
    row covers absolute positions [s * FIXED_SPLIT_SIZE, (s + 1) * FIXED_SPLIT_SIZE), the tile size and warps
    depend on the head dims only, and the row's splits merge in ascending order. A row's result is therefore
    bitwise the same in any batch and for any grid split count `num_splits` that covers the page table
    (>= fixed_num_splits of its capacity; CUDA graphs capture the count of their longest context). With FP8 KV
    the dequantization is per key (scores x K's row scale, probabilities x V's), the same in any batch."""
    bsz, hq, _ = q.shape
    hkv, dk, dv = k_buf.shape[1], k_buf.shape[-1], v_buf.shape[-1]
    q_tail = _query_tail(q, q_tail, dk, dv)
    if num_splits < fixed_num_splits(page_table.shape[1] * page_size):
        raise ValueError(f"fixed-split attention: {num_splits} splits do not cover the page table's "
                         f"{page_table.shape[1] * page_size} positions")
    layout = _layout(q, k_buf, v_buf, "query")  # batch-invariant mode keeps the query's dtype in its dots
    ks, vs = _scales(k_buf, v_buf, k_scale, v_scale)
    if out is None:
        out = q.new_empty(bsz, hq, dv)
    rows = max(1, min(bsz, _FIXED_PART_BYTES // (hq * num_splits * dv * 4)))
    part_o = torch.empty(rows, hq, num_splits, dv, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(rows, hq, num_splits, dtype=torch.float32, device=q.device)
    for r0 in range(0, bsz, rows):
        r1 = min(bsz, r0 + rows)
        lens = seq_lens[r0:r1]
        _fixed_split_kernel[(r1 - r0, hkv * layout["HEAD_BLOCKS"], num_splits)](
            q[r0:r1], q_tail[r0:r1], k_buf, v_buf, ks, vs, page_table, table_rows[r0:r1], lens, part_o, part_lse,
            q.stride(0), q.stride(1), q_tail.stride(0), q_tail.stride(1), k_buf.stride(0), k_buf.stride(1),
            v_buf.stride(0), v_buf.stride(1), ks.stride(0), vs.stride(0),
            page_table.stride(0), scale, page_size, num_splits,
            BLOCK_N=FIXED_BLOCK_N if dk <= 256 else FIXED_BLOCK_N // 2,
            SPLIT_SIZE=FIXED_SPLIT_SIZE, **layout, num_warps=4, num_stages=2)
        o = out[r0:r1]
        _merge_fixed_splits_kernel[(r1 - r0, hq)](part_o, part_lse, lens, o, o.stride(0), o.stride(1), num_splits,
                                                  NUM_HEADS=hq, SPLIT_SIZE=FIXED_SPLIT_SIZE, DV=dv, num_warps=4)
    return out
