"""Sparse multi-query attention with sinks (DeepSeek-V4) in Triton: one KV head that is both key and value (K = V),
H query heads, a learned per-head logit (the sink) in every softmax denominator, and keys gathered from several
sources.

A source is (buffer (N, D), rows, mask): the keys of group g are buffer rows `rows[g, l]`; rows of -1 are no key.
`rows` is (G, L), shared by the group's Q queries, or (G, Q, L), one list per query (the indexer's top-k in a
prefill block); `mask` (G, Q, L) bool (True = attend) is optional. V4 passes the sliding-window keys and the
compressed entries (all of them for HCA, the top-k for CSA) as two sources; nothing here knows the cache layout.

FP8 sources (the compact pool's kv_cache_dtype 'fp8_e4m3'): the buffer holds float8_e4m3fn rows and `scales` one
fp32 scale per row (value = row * scale). A tile is loaded as FP8 (half the bytes of bf16) and converted to the
queries' dtype exactly in registers (every e4m3 value is a bf16 / fp16 / fp32 value); the row scales multiply
the tile's scores, and the probabilities before p.V (l keeps the unscaled ones), with fp32 accumulation, so
the dequantized rows are never built. A source of 16-bit rows and one of FP8 rows may be mixed in one call.

MXFP4 sources (DeepSeek-V4.1's kv_cache_dtype 'fp4_e2m1' entries): the buffer holds uint8 rows of D / 2 bytes,
two e2m1 codes each (column 2j in the low nibble), and `scales` uint8 rows of D / B e8m0 bytes (2^(byte - 127),
B = 32 or 16 columns per scale). The scale varies along D, so a tile is dequantized in registers (code -> value
by its bits, times the power of two built from its exponent byte; exact in the queries' dtype) before the dots.
A scale byte of 0 reads as 0 (only blocks whose amax is below 6 * 2^-127 store it).

Each source's keys are cut into splits of whole BLOCK_N tiles. One program handles one (group, tile of
query-head rows, split): rows are (query, head) pairs flattened query-major, so the queries of a prefill block
and all heads of a decode query share each key tile they load. A program writes its split's normalised output
and base-2 log-sum-exp in fp32; the combine kernel merges every split of every source with the sink. The split
counts depend on the shapes only (never on values), so no host read happens and a CUDA graph can capture it.
Where no source needs a split (decode batches that fill the GPU, prefill chunks) one fused program per (group, tile
of rows) runs over both sources in turn and writes the output with the sink merged: no fp32 partials, no combine.

Fixed-split mode (`fixed_splits=True`, batch-invariant attention): split s of every key list covers list
positions [s * FIXED_SPLIT_LEN, (s + 1) * FIXED_SPLIT_LEN) and every program one (query, head block), so a
row's tiles, splits and the order the combine merges them in (sources in order, splits ascending) depend on its
own key list only. Keys past a row's list (the padding of a wider batch) add exact zeros: a tile no row sees is
skipped, an empty split has weight 0. With key lists whose valid keys sit at the same positions whatever the
batch (decode rows: left-aligned; models/deepseek_v4/invariant.key_lists), the output is bitwise the same in
any batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

LOG2E = 1.4426950408889634


@dataclass
class KeySource:
    buf: torch.Tensor
    """(N, D) key rows (a column view of a wider pool row is fine: its last dim must be contiguous)."""
    rows: torch.Tensor
    """(G, L) or (G, Q, L) integer rows of `buf`; -1 = no key."""
    mask: torch.Tensor | None = None
    """(G, Q, L) bool, True = attend; None = every row >= 0."""
    scales: torch.Tensor | None = None
    """(N,) or (N, 1) fp32 row scales of a float8_e4m3fn `buf`, (N, D / B) uint8 e8m0 block scales of a uint8
    (MXFP4) `buf` (None for rows in the queries' dtype)."""

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """buf rows at idx (any shape, all >= 0) in fp32, dequantized (the references' reading)."""
        if self.buf.dtype == torch.uint8:
            return dequantize_fp4_rows(self.buf[idx], self.scales[idx])
        rows = self.buf[idx].float()
        if self.scales is not None:
            rows = rows * self.scales.reshape(-1)[idx][..., None]
        return rows


_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_fp4_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 (..., D / 2) e2m1 pairs (column 2j low) and uint8 (..., D / B) e8m0 bytes -> (..., D) fp32."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(_E2M1, dtype=torch.float32, device=packed.device)[codes]
    exp = scales.to(torch.int32) - 127
    blocks = values.unflatten(-1, (scales.shape[-1], -1))
    return torch.ldexp(blocks, exp[..., None]).flatten(-2)


@triton.jit
def fp4_tile(Buf, Scales, rows, stride_bn, stride_sn, offs_d, valid, FP4_BLOCK: tl.constexpr):
    """(N, BLOCK_D) fp32 values of MXFP4 rows `rows` (columns offs_d; 0 where not `valid`)."""
    byte = tl.load(Buf + rows[:, None] * stride_bn + offs_d[None, :] // 2, mask=valid, other=0).to(tl.int32)
    code = (byte >> ((offs_d[None, :] % 2) * 4)) & 15
    e = (code >> 1) & 3
    half = (code & 1).to(tl.float32) * 0.5
    mag = tl.where(e == 0, half, tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)) * (1.0 + half))
    value = tl.where(code >= 8, -mag, mag)
    sb = tl.load(Scales + rows[:, None] * stride_sn + offs_d[None, :] // FP4_BLOCK, mask=valid, other=0)
    scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(byte - 127); byte 0 -> 0
    return value * scale


@triton.jit
def _attend(q, m_i, l_i, acc, Buf, Scales, row_base, mask_base, qb, qi, mvalid, offs_d, dmask, start, end, stride_bn,
            stride_sn, stride_mq, qk_scale, QPB: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
            IEEE: tl.constexpr, KV_FP8: tl.constexpr, KV_FP4: tl.constexpr, FP4_BLOCK: tl.constexpr):
    """The online softmax state (m_i, l_i, acc) of one program's (query, head) rows moved over key list positions
    [start, end) of one source (rows at row_base, mask rows at mask_base): scores in base 2, acc unnormalised."""
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        rows = tl.load(row_base + offs_n, mask=nmask, other=-1).to(tl.int64)
        kvalid = rows >= 0
        valid = mvalid[:, None] & kvalid[None, :]
        if HAS_MASK:
            if QPB == 1:  # every row of the program is one query's: one mask row (fewer registers)
                seen = tl.load(mask_base + qb * stride_mq + offs_n, mask=nmask, other=0)
                valid = valid & (seen != 0)[None, :]
            else:
                seen = tl.load(mask_base + qi[:, None] * stride_mq + offs_n[None, :],
                               mask=mvalid[:, None] & nmask[None, :], other=0)
                valid = valid & (seen != 0)
        if tl.max(tl.max(valid.to(tl.int32), 1), 0) > 0:  # tiles no row of this program sees are skipped
            safe = tl.where(kvalid, rows, 0)
            if KV_FP4:  # (N, D), also V: dequantized in registers, exact in q's dtype
                k = fp4_tile(Buf, Scales, safe, stride_bn, stride_sn, offs_d, kvalid[:, None] & dmask[None, :],
                             FP4_BLOCK).to(q.dtype)
            else:
                k = tl.load(Buf + safe[:, None] * stride_bn + offs_d[None, :],
                            mask=kvalid[:, None] & dmask[None, :], other=0.0)  # (N, D), also V
            if KV_FP8:  # exact conversion; the row scales apply to the scores and the probabilities
                k = k.to(q.dtype)
                ks = tl.load(Scales + safe * stride_sn, mask=kvalid, other=0.0)
            if IEEE:  # fp32 pools: full fp32 products (TF32 would drift from the torch path)
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            if KV_FP8:
                qk = qk * ks[None, :]
            qk = tl.where(valid, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_FP8:
                p = p * ks[None, :]
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
            m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _program_rows(H: tl.constexpr, BLOCK_H: tl.constexpr, QPB: tl.constexpr, num_q):
    """Query-block, head-block and the (query, head) rows of tile program_id(1)."""
    tile = tl.program_id(1)
    num_hb = tl.cdiv(H, BLOCK_H)
    qb, hb = tile // num_hb, tile % num_hb
    offs_m = tl.arange(0, QPB * BLOCK_H)
    qi = qb * QPB + offs_m // BLOCK_H
    h = hb * BLOCK_H + offs_m % BLOCK_H
    return qb, qi, h, (qi < num_q) & (h < H)


@triton.jit
def _split_kernel(Q, Buf, Scales, Rows, Mask, PartO, PartLse,
                  stride_qg, stride_qq, stride_qh, stride_bn, stride_sn, stride_rg, stride_rq, stride_mg, stride_mq,
                  num_q, num_keys, split_len, split_base, total_splits, qk_scale,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                  QPB: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
                  KV_FP8: tl.constexpr, KV_FP4: tl.constexpr = False, FP4_BLOCK: tl.constexpr = 32,
                  PDL: tl.constexpr = False):
    pdl_wait(PDL)
    g = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    qb, qi, h, mvalid = _program_rows(H, BLOCK_H, QPB, num_q)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + g * stride_qg + qi[:, None] * stride_qq + h[:, None] * stride_qh + offs_d[None, :],
                mask=mvalid[:, None] & dmask[None, :], other=0.0)
    row_base = Rows + g * stride_rg + qb * QPB * stride_rq  # QPB == 1 whenever the rows are per query
    m_i = tl.full([QPB * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([QPB * BLOCK_H], tl.float32)
    acc = tl.zeros([QPB * BLOCK_H, BLOCK_D], tl.float32)
    start = split * split_len
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, Buf, Scales, row_base, Mask + g * stride_mg, qb, qi, mvalid, offs_d,
                            dmask, start, tl.minimum(start + split_len, num_keys), stride_bn, stride_sn, stride_mq,
                            qk_scale, QPB, BLOCK_N, HAS_MASK, IEEE, KV_FP8, KV_FP4, FP4_BLOCK)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    part = ((g * num_q + qi) * H + h) * total_splits + split_base + split
    tl.store(PartO + part[:, None] * D + offs_d[None, :], out, mask=mvalid[:, None] & dmask[None, :])
    tl.store(PartLse + part, lse, mask=mvalid)


@triton.jit
def _fused_kernel(Q, Sink, O, stride_qg, stride_qq, stride_qh, num_q, qk_scale,
                  BufA, ScalesA, RowsA, MaskA, stride_bnA, stride_snA, stride_rgA, stride_rqA, stride_mgA, stride_mqA,
                  num_keysA,
                  BufB, ScalesB, RowsB, MaskB, stride_bnB, stride_snB, stride_rgB, stride_rqB, stride_mgB, stride_mqB,
                  num_keysB,
                  H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, QPB: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                  HAS_MASK_A: tl.constexpr, FP8_A: tl.constexpr, FP4_A: tl.constexpr, FP4_BLOCK_A: tl.constexpr,
                  HAS_B: tl.constexpr, HAS_MASK_B: tl.constexpr, FP8_B: tl.constexpr, FP4_B: tl.constexpr,
                  FP4_BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    """One program per (group, tile of rows) over every key of one or two sources, the sink merged in and the
    output written in O's dtype: the split kernel and the combine in one, where no source needs a split."""
    pdl_wait(PDL)
    g = tl.program_id(0).to(tl.int64)
    qb, qi, h, mvalid = _program_rows(H, BLOCK_H, QPB, num_q)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + g * stride_qg + qi[:, None] * stride_qq + h[:, None] * stride_qh + offs_d[None, :],
                mask=mvalid[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([QPB * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([QPB * BLOCK_H], tl.float32)
    acc = tl.zeros([QPB * BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend(q, m_i, l_i, acc, BufA, ScalesA, RowsA + g * stride_rgA + qb * QPB * stride_rqA,
                            MaskA + g * stride_mgA, qb, qi, mvalid, offs_d, dmask, 0, num_keysA, stride_bnA,
                            stride_snA, stride_mqA, qk_scale, QPB, BLOCK_N, HAS_MASK_A, IEEE, FP8_A, FP4_A, FP4_BLOCK_A)
    if HAS_B:
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, BufB, ScalesB, RowsB + g * stride_rgB + qb * QPB * stride_rqB,
                                MaskB + g * stride_mgB, qb, qi, mvalid, offs_d, dmask, 0, num_keysB,
                                stride_bnB, stride_snB, stride_mqB, qk_scale, QPB, BLOCK_N, HAS_MASK_B, IEEE, FP8_B, FP4_B,
                                FP4_BLOCK_B)
    sink = tl.load(Sink + h, mask=h < H, other=0.0).to(tl.float32) * 1.4426950408889634
    m = tl.maximum(m_i, sink)  # the sink is finite, so m is
    w = tl.exp2(m_i - m)  # 0 for a row that saw no key (m_i = -inf, acc = l_i = 0)
    total = l_i * w + tl.exp2(sink - m)
    out = acc * (w / total)[:, None]
    r = (g * num_q + qi) * H + h
    tl.store(O + r[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty), mask=mvalid[:, None] & dmask[None, :])


@triton.jit
def _combine_kernel(PartO, PartLse, Sink, O, total_splits, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Rows r = (g * Q + q) * H + h of one query's head block: their splits and the sink merged into O[r]
    (rows of D, contiguous)."""
    pdl_wait(PDL)
    gq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    r = gq * H + h
    sink = tl.load(Sink + h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(PartLse + r[:, None] * total_splits + offs_s[None, :],
                  mask=hmask[:, None] & (offs_s < total_splits)[None, :], other=float("-inf"))
    m = tl.maximum(tl.max(lse, 1), sink)  # the sink is finite, so m is
    offs_d = tl.arange(0, BLOCK_D)
    mask = hmask[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.exp2(sink - m)
    for s in range(0, total_splits):
        w = tl.exp2(tl.load(PartLse + r * total_splits + s, mask=hmask, other=float("-inf")) - m)  # 0: empty split
        part = tl.load(PartO + (r * total_splits + s)[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
        acc += tl.where(w[:, None] > 0.0, part, 0.0) * w[:, None]
        total += w
    tl.store(O + r[:, None] * D + offs_d[None, :], (acc / total[:, None]).to(O.dtype.element_ty), mask=mask)


BLOCK_N = 32
"""Keys per tile (D = 512 keys: 32 KiB of bf16 per tile)."""
FIXED_SPLIT_LEN = 256
"""Keys per split in fixed-split mode (a multiple of BLOCK_N)."""
TARGET_PROGRAMS = 528
"""Split programs aimed at (4 per SM of an H200): decode batches small enough to leave SMs idle split their keys."""
WIDE_FUSED_PROGRAMS = 1024
"""Fused decode launches of at least this many 16-row programs take 32 rows a program instead (half the programs,
each key tile read by twice the heads): at V4-Flash's 64 heads, batch 256 and up. On an H100 (bench_v4_attention.py) 32
rows took 0.86-0.93x the time of 16 at batch 256 and 1.1-1.6x at batch 64."""


@dataclass(frozen=True)
class Tiles:
    """The launch shape (benchmarks try others; results are the same up to fp32 summation order)."""
    block_n: int = BLOCK_N
    """Keys per tile."""
    max_rows: int | None = None
    """(query, head) rows per program at most (None: what keeps a (rows, D) fp32 accumulator in registers)."""
    num_warps: int | None = None
    num_stages: int = 2
    maxnreg: int | None = None
    """Registers a thread at most (None: the compiler's choice)."""

    def launch(self, d: int) -> dict:
        """num_warps, num_stages (and maxnreg) for keys of width d."""
        warps = self.num_warps or (8 if triton.next_power_of_2(d) >= 256 else 4)
        return dict(num_warps=warps, num_stages=self.num_stages, **({"maxnreg": self.maxnreg} if self.maxnreg else {}))


def _tiling(num_q: int, num_heads: int, d: int, per_query_rows: bool, max_rows: int | None = None) -> tuple[int, int]:
    """(queries per program, heads per program): at least 16 (query, head) rows for tl.dot, and at most what keeps
    the fp32 accumulator (rows, D) in registers (16 rows at D = 512). One query per program for per-query rows
    (and in fixed-split mode: the tiling then depends on the heads and D only)."""
    max_rows = max_rows or min(64, max(16, 8192 // triton.next_power_of_2(d)))
    block_h = min(triton.next_power_of_2(num_heads), max_rows)
    qpb = 1 if per_query_rows else max(1, min(triton.next_power_of_2(num_q), max_rows // block_h))
    while qpb * block_h < 16:
        block_h *= 2
    return qpb, block_h


def _check(q: torch.Tensor, src: KeySource) -> None:
    g, num_q, _, d = q.shape
    if src.buf.dtype == torch.uint8:
        check_fp4(src.buf, src.scales, d, "a key source")
    elif src.buf.dim() != 2 or src.buf.shape[1] != d or src.buf.stride(1) != 1:
        raise ValueError(f"a key source's buffer must be (N, {d}) with contiguous rows, got {tuple(src.buf.shape)}")
    if src.buf.dtype == torch.uint8:
        pass  # checked above
    elif src.buf.dtype == torch.float8_e4m3fn:
        s = src.scales
        if s is None or s.dtype != torch.float32 or s.numel() != src.buf.shape[0] or s.dim() > 2 or (
                s.dim() == 2 and s.shape[1] != 1):
            raise ValueError(f"a float8_e4m3fn key source needs fp32 row scales of shape ({src.buf.shape[0]},) or "
                             f"({src.buf.shape[0]}, 1), got {None if s is None else (s.dtype, tuple(s.shape))}")
    elif src.buf.dtype != q.dtype:
        raise ValueError(f"key source dtype {src.buf.dtype} differs from the queries' {q.dtype}")
    elif src.scales is not None:
        raise ValueError("row scales come with float8_e4m3fn key buffers only")
    if src.rows.dim() not in (2, 3) or src.rows.shape[0] != g or (src.rows.dim() == 3 and src.rows.shape[1] != num_q):
        raise ValueError(f"key rows must be (G, L) or (G, Q, L) with G={g}, Q={num_q}, got {tuple(src.rows.shape)}")
    if src.mask is not None and src.mask.shape != (g, num_q, src.rows.shape[-1]):
        raise ValueError(f"key mask must be (G, Q, L) = {(g, num_q, src.rows.shape[-1])}, got {tuple(src.mask.shape)}")


def check_fp4(buf: torch.Tensor, scales: torch.Tensor | None, d: int, what: str) -> int:
    """ValueError unless buf (N, d / 2) uint8 and scales (N, d / B) uint8 with B 16 or 32 are MXFP4 rows of width
    d with contiguous columns; returns B."""
    n = buf.shape[0]
    if buf.dim() != 2 or buf.shape[1] * 2 != d or buf.stride(1) != 1:
        raise ValueError(f"{what}'s MXFP4 rows must be (N, {d // 2}) uint8 with contiguous columns, "
                         f"got {tuple(buf.shape)}")
    if (scales is None or scales.dtype != torch.uint8 or scales.dim() != 2 or scales.shape[0] != n
            or scales.stride(1) != 1 or scales.shape[1] == 0 or d % scales.shape[1]
            or d // scales.shape[1] not in (16, 32)):
        raise ValueError(f"{what}'s MXFP4 rows need uint8 e8m0 scales ({n}, {d} / 32 or {d} / 16), "
                         f"got {None if scales is None else (scales.dtype, tuple(scales.shape))}")
    return d // scales.shape[1]


def sparse_mqa_attention(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor, sm_scale: float,
                         split_len: int | None = None, fixed_splits: bool = False, pdl: bool = False,
                         fuse: bool | None = None, tiles: Tiles = Tiles()) -> torch.Tensor:
    """q (G, Q, H, D) over the keys of `sources` with the per-head sink (H,) -> (G, Q, H, D) in q's dtype: for
    each (query, head) softmax over [q.k * sm_scale for its visible keys, sink], applied to the keys (K = V).
    A row that sees no key gives zeros. `split_len` (keys per split, a multiple of the tile) overrides the
    choice from the shapes (tests); `fixed_splits` is the batch-invariant mode (module docstring). Where no
    source needs a split (decode batches that fill the GPU by themselves) one program per (group, tile of rows)
    reads both sources and writes the output with the sink merged (no fp32 partials, no combine launch);
    `fuse` False keeps the split and combine kernels, True requires the fused one (ValueError where it can't)."""
    if fixed_splits and split_len is not None:
        raise ValueError("fixed_splits sets the split length itself (FIXED_SPLIT_LEN)")
    g, num_q, num_heads, d = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_n = tiles.block_n
    plans = []
    for src in sources:
        _check(q, src)
        per_query = src.rows.dim() == 3 and num_q > 1
        qpb, block_h = _tiling(num_q, num_heads, d, per_query or fixed_splits, tiles.max_rows)
        num_tiles = triton.cdiv(num_q, qpb) * triton.cdiv(num_heads, block_h)
        num_keys = src.rows.shape[-1]
        if fixed_splits:
            length = FIXED_SPLIT_LEN
        elif split_len is None:
            want = max(1, TARGET_PROGRAMS // max(1, g * num_tiles * len(sources)))
            length = triton.cdiv(triton.cdiv(max(num_keys, 1), want), block_n) * block_n
        else:
            length = split_len
        plans.append(_Plan(src, per_query, qpb, block_h, num_tiles, num_keys, length,
                           max(1, triton.cdiv(num_keys, length))))
    can_fuse = not fixed_splits and 1 <= len(plans) <= 2 and all(p.splits == 1 for p in plans)
    if fuse and not can_fuse:
        raise ValueError("the fused kernel takes one or two sources that need no split")
    block_d = triton.next_power_of_2(d)
    out = torch.empty(g, num_q, num_heads, d, dtype=q.dtype, device=q.device)
    if can_fuse and fuse is not False:
        # one tiling for both sources: one query a program where either has per-query rows (at D = 512 every
        # source's tiling already is)
        a, b = plans[0], plans[-1]
        per_query = a.per_query or b.per_query
        qpb, block_h = _tiling(num_q, num_heads, d, per_query, tiles.max_rows)
        if (tiles.max_rows is None and num_q == 1 and d >= 512 and qpb * block_h == 16
                and g * triton.cdiv(num_heads, block_h) >= WIDE_FUSED_PROGRAMS):  # decode batches: as measured
            qpb, block_h = _tiling(num_q, num_heads, d, per_query, 32)
        num_tiles = triton.cdiv(num_q, qpb) * triton.cdiv(num_heads, block_h)
        _fused_kernel[(g, num_tiles)](
            q, sink.float().contiguous(), out, q.stride(0), q.stride(1), q.stride(2), num_q, sm_scale * LOG2E,
            *a.args(), *b.args(), H=num_heads, D=d, BLOCK_D=block_d, BLOCK_H=block_h, QPB=qpb, BLOCK_N=block_n,
            IEEE=q.dtype == torch.float32, **a.flags("_A"), HAS_B=len(plans) == 2, **b.flags("_B"),
            **tiles.launch(d), **pdl_launch(pdl))
        return out
    total = sum(p.splits for p in plans)
    part_o = torch.empty(g * num_q * num_heads * total, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(g * num_q * num_heads * total, dtype=torch.float32, device=q.device)
    base = 0
    for plan in plans:
        buf, scales, rows, mask, stride_bn, stride_sn, stride_rg, stride_rq, stride_mg, stride_mq, num_keys = \
            plan.args()
        flags = plan.flags()
        _split_kernel[(g, plan.num_tiles, plan.splits)](
            q, buf, scales, rows, mask, part_o, part_lse, q.stride(0), q.stride(1), q.stride(2), stride_bn, stride_sn,
            stride_rg, stride_rq, stride_mg, stride_mq, num_q, num_keys, plan.length, base, total, sm_scale * LOG2E,
            H=num_heads, D=d, BLOCK_D=block_d, BLOCK_H=plan.block_h, QPB=plan.qpb, BLOCK_N=block_n,
            HAS_MASK=flags["HAS_MASK"], IEEE=q.dtype == torch.float32, KV_FP8=flags["FP8"], KV_FP4=flags["FP4"],
            FP4_BLOCK=flags["FP4_BLOCK"], **tiles.launch(d), **pdl_launch(pdl))
        base += plan.splits
    combine_h = min(16, triton.next_power_of_2(num_heads))
    _combine_kernel[(g * num_q, triton.cdiv(num_heads, combine_h))](
        part_o, part_lse, sink.float().contiguous(), out, total, H=num_heads, D=d, BLOCK_D=block_d,
        BLOCK_H=combine_h, BLOCK_S=max(2, triton.next_power_of_2(total)), num_warps=4, **pdl_launch(pdl))
    return out


@dataclass
class _Plan:
    """One source's launch: its tiling and split."""
    src: KeySource
    per_query: bool
    qpb: int
    block_h: int
    num_tiles: int
    num_keys: int
    length: int
    splits: int

    def args(self) -> tuple:
        """buf, scales, rows, mask, and the strides of buf rows, scales, rows (group, query) and mask (group,
        query), then the key count: the kernels' per-source arguments (a missing mask or scales passes rows)."""
        src = self.src
        rows = src.rows if src.rows.dim() == 3 else src.rows[:, None]
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        mask = src.mask
        if mask is not None:
            mask = (mask if mask.stride(-1) == 1 else mask.contiguous()).view(torch.uint8)
        scaled = src.buf.dtype in (torch.float8_e4m3fn, torch.uint8)
        return (src.buf, src.scales if scaled else src.buf, rows, mask if mask is not None else rows,
                src.buf.stride(0), src.scales.stride(0) if scaled else 0, rows.stride(0),
                rows.stride(1) if self.per_query else 0,
                mask.stride(0) if mask is not None else 0, mask.stride(1) if mask is not None else 0, self.num_keys)

    def flags(self, suffix: str = "") -> dict:
        src = self.src
        fp4 = src.buf.dtype == torch.uint8
        return {f"HAS_MASK{suffix}": src.mask is not None, f"FP8{suffix}": src.buf.dtype == torch.float8_e4m3fn,
                f"FP4{suffix}": fp4, f"FP4_BLOCK{suffix}": d_per_scale(src) if fp4 else 32}


def d_per_scale(src: KeySource) -> int:
    """Columns per e8m0 scale of an MXFP4 source."""
    return 2 * src.buf.shape[1] // src.scales.shape[1]


def sparse_mqa_attention_ref(q: torch.Tensor, sources: Sequence[KeySource], sink: torch.Tensor,
                             sm_scale: float) -> torch.Tensor:
    """Torch reference of sparse_mqa_attention in fp32 (the layout of V4Method.attend: concatenated sources,
    masked scores, the sink as one more logit); FP8 and MXFP4 sources are read dequantized (KeySource.gather)."""
    g, num_q, num_heads, d = q.shape
    keys, masks = [], []
    for src in sources:
        rows = src.rows if src.rows.dim() == 3 else src.rows[:, None].expand(g, num_q, src.rows.shape[-1])
        seen = rows >= 0
        if src.mask is not None:
            seen = seen & src.mask
        keys.append(src.gather(rows.clamp(min=0)))  # (G, Q, L, D)
        masks.append(seen)
    k, seen = torch.cat(keys, dim=2), torch.cat(masks, dim=2)
    scores = torch.einsum("gqhd,gqld->gqhl", q.float(), k) * sm_scale
    scores = scores.masked_fill(~seen[:, :, None, :], float("-inf"))
    logits = torch.cat([scores, sink.float().view(1, 1, -1, 1).expand(g, num_q, num_heads, 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("gqhl,gqld->gqhd", probs, k).to(q.dtype)
