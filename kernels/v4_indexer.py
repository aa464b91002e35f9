"""DeepSeek-V4's lightning indexer in Triton: logits sum_h w_h * relu(q_h . k_e) * scale of each query over its
group's entries, -inf where an entry is absent or not visible; the top-k is `reference.stable_topk` (ties to the
earlier entry), the rule of the torch path -- or, with `as_keys`, the kernel writes stable_topk's int64 keys
itself and `reference.topk_of_keys` takes the top-k from them (about a dozen launches fewer per indexer).

One program scores one tile of entries for a tile of queries of one group: rows are (query, head) pairs, so one
tl.dot gives every head's product and the head sum is a reduction over the reshaped tile; each key tile is read
once per query tile.

FP8 index keys (kv_cache_dtype 'fp8_e4m3'): float8_e4m3fn rows with one fp32 scale per row, converted to the
queries' dtype in registers (exactly) with the row scale applied to the products (before the ReLU: a scale is
positive), so the dequantized keys are never built. MXFP4 index keys (DeepSeek-V4.1's 'fp4_e2m1'): uint8 rows of
two e2m1 codes per byte with uint8 e8m0 scales per 32 (or 16) columns, dequantized in registers as the attention
kernel's MXFP4 sources are (v4_attention.fp4_tile), exactly in the queries' dtype.

Fixed-order mode (`fixed_order=True`, batch-invariant mode): the queries per program are a constant of the head
count (at least 16 (query, head) rows for tl.dot), never of the number of queries, so an entry's score is made
by the same tile shapes, the same products and the same head reduction whatever the batch: entry e of a group
sits at column e % BLOCK_E of entry tile e // BLOCK_E, and a program's other rows (other queries, padding)
never enter its sums.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

from deepinfer_kernels.v4_attention import check_fp4, dequantize_fp4_rows, fp4_tile

BLOCK_E = 64
"""Entries per program."""


@triton.jit
def _index_scores_kernel(Q, W, Buf, Scales, Rows, Mask, Out,
                         stride_qg, stride_qq, stride_qh, stride_wg, stride_wq, stride_bn, stride_sn, stride_rg,
                         stride_mg, stride_mq, stride_og, stride_oq,
                         num_q, num_entries, scale,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, DI: tl.constexpr, BLOCK_DI: tl.constexpr,
                         QPB: tl.constexpr, BLOCK_E: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
                         KV_FP8: tl.constexpr, KV_FP4: tl.constexpr = False, FP4_BLOCK: tl.constexpr = 32,
                         KEYS: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)
    g = tl.program_id(0).to(tl.int64)
    qb = tl.program_id(1)
    eb = tl.program_id(2)
    offs_m = tl.arange(0, QPB * BLOCK_H)
    qi = qb * QPB + offs_m // BLOCK_H
    h = offs_m % BLOCK_H
    mvalid = (qi < num_q) & (h < H)
    offs_d = tl.arange(0, BLOCK_DI)
    dmask = offs_d < DI
    q = tl.load(Q + g * stride_qg + qi[:, None] * stride_qq + h[:, None] * stride_qh + offs_d[None, :],
                mask=mvalid[:, None] & dmask[None, :], other=0.0)
    w = tl.load(W + g * stride_wg + qi * stride_wq + h, mask=mvalid, other=0.0)
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = offs_e < num_entries
    rows = tl.load(Rows + g * stride_rg + offs_e, mask=emask, other=-1).to(tl.int64)
    kvalid = rows >= 0
    safe = tl.where(kvalid, rows, 0)
    if KV_FP4:
        k = fp4_tile(Buf, Scales, safe, stride_bn, stride_sn, offs_d, kvalid[:, None] & dmask[None, :],
                     FP4_BLOCK).to(q.dtype)
    else:
        k = tl.load(Buf + safe[:, None] * stride_bn + offs_d[None, :], mask=kvalid[:, None] & dmask[None, :],
                    other=0.0)
    if KV_FP8:
        k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if KV_FP8:
        s = s * tl.load(Scales + safe * stride_sn, mask=kvalid, other=0.0)[None, :]
    s = (tl.maximum(s, 0.0) * scale) * w[:, None]  # (QPB * BLOCK_H, BLOCK_E), padded heads weigh 0
    total = tl.sum(tl.reshape(s, (QPB, BLOCK_H, BLOCK_E)), 1)  # (QPB, BLOCK_E)
    offs_q = qb * QPB + tl.arange(0, QPB)
    qvalid = offs_q < num_q
    valid = qvalid[:, None] & kvalid[None, :]
    if HAS_MASK:
        seen = tl.load(Mask + g * stride_mg + offs_q[:, None] * stride_mq + offs_e[None, :],
                       mask=qvalid[:, None] & emask[None, :], other=0)
        valid = valid & (seen != 0)
    out = tl.where(valid, total, float("-inf"))
    if KEYS:  # reference.stable_topk's int64 key: the score's order-preserving bits over the entry's complement
        out = tl.where(out == 0.0, 0.0, out)  # -0.0 counts as +0.0
        bits = out.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        low = tl.full([BLOCK_E], 4294967295, tl.int64) - offs_e.to(tl.int64)
        out = (ordered.to(tl.int64) << 32) + low[None, :]
    tl.store(Out + g * stride_og + offs_q[:, None] * stride_oq + offs_e[None, :], out,
             mask=qvalid[:, None] & emask[None, :])


def _check_scales(buf: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether buf holds FP8 rows (then with fp32 row scales (N,) or (N, 1))."""
    if buf.dtype != torch.float8_e4m3fn:
        if scales is not None:
            raise ValueError("row scales come with float8_e4m3fn index keys only")
        return False
    if scales is None or scales.dtype != torch.float32 or scales.numel() != buf.shape[0] or scales.dim() > 2 or (
            scales.dim() == 2 and scales.shape[1] != 1):
        raise ValueError(f"float8_e4m3fn index keys need fp32 row scales of shape ({buf.shape[0]},) or "
                         f"({buf.shape[0]}, 1), got {None if scales is None else (scales.dtype, tuple(scales.shape))}")
    return True


def index_scores(q: torch.Tensor, weights: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                 visible: torch.Tensor | None, scale: float, scales: torch.Tensor | None = None,
                 fixed_order: bool = False, as_keys: bool = False, pdl: bool = False) -> torch.Tensor:
    """q (G, Q, H, Di), weights (G, Q, H) fp32, key rows `buf[rows]` (buf (N, Di), rows (G, E), -1 = none),
    visible (G, Q, E) bool or None -> (G, Q, E) fp32 scores, -inf where absent or not visible. A float8_e4m3fn
    buf comes with its fp32 row `scales` (N,) or (N, 1), a uint8 (MXFP4) buf (N, Di / 2) with its uint8 e8m0
    `scales` (N, Di / 32 or Di / 16). `fixed_order`: the batch-invariant tiling (module docstring). `as_keys`:
    each score's int64 sort key instead (`reference.stable_topk_keys`; `topk_of_keys` picks from them), so the
    top-k needs no pass of its own to build them."""
    g, num_q, num_heads, di = q.shape
    fp4 = buf.dtype == torch.uint8
    if fp4:
        fp4_block = check_fp4(buf, scales, di, "the indexer keys")
    elif buf.dim() != 2 or buf.shape[1] != di or buf.stride(1) != 1:
        raise ValueError(f"indexer keys must be (N, {di}) with contiguous rows, got {tuple(buf.shape)}")
    fp8 = not fp4 and _check_scales(buf, scales)
    if rows.shape[0] != g or rows.dim() != 2:
        raise ValueError(f"indexer rows must be (G, E) with G={g}, got {tuple(rows.shape)}")
    num_entries = rows.shape[1]
    if visible is not None and visible.shape != (g, num_q, num_entries):
        raise ValueError(f"indexer visibility must be {(g, num_q, num_entries)}, got {tuple(visible.shape)}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights.float().contiguous()
    rows = rows.contiguous()
    block_h = triton.next_power_of_2(num_heads)
    qpb = max(1, 16 // block_h)
    if not fixed_order:
        qpb = max(qpb, min(triton.next_power_of_2(num_q), max(1, 64 // block_h)))
    out = torch.empty(g, num_q, num_entries, dtype=torch.int64 if as_keys else torch.float32, device=q.device)
    mask = visible.contiguous().view(torch.uint8) if visible is not None else None
    if buf.dtype != q.dtype and not fp8 and not fp4:
        buf = buf.to(q.dtype)
    grid = (g, triton.cdiv(num_q, qpb), triton.cdiv(max(num_entries, 1), BLOCK_E))
    _index_scores_kernel[grid](
        q, weights, buf, scales if fp8 or fp4 else buf, rows, mask if mask is not None else rows, out,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), buf.stride(0),
        scales.stride(0) if fp8 or fp4 else 0, rows.stride(0),
        mask.stride(0) if mask is not None else 0, mask.stride(1) if mask is not None else 0,
        out.stride(0), out.stride(1), num_q, num_entries, scale,
        H=num_heads, BLOCK_H=block_h, DI=di, BLOCK_DI=triton.next_power_of_2(di), QPB=qpb, BLOCK_E=BLOCK_E,
        HAS_MASK=mask is not None, IEEE=q.dtype == torch.float32, KV_FP8=fp8, KEYS=as_keys, num_warps=4,
        **(dict(KV_FP4=True, FP4_BLOCK=fp4_block) if fp4 else {}), **pdl_launch(pdl))
    return out


def index_scores_ref(q: torch.Tensor, weights: torch.Tensor, buf: torch.Tensor, rows: torch.Tensor,
                     visible: torch.Tensor | None, scale: float, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of index_scores, in the order of V4Method.index_select (FP8 and MXFP4 keys dequantized)."""
    if buf.dtype == torch.uint8:
        keys = dequantize_fp4_rows(buf[rows.clamp(min=0)], scales[rows.clamp(min=0)])
    else:
        keys = buf[rows.clamp(min=0)].float()
    if buf.dtype != torch.uint8 and _check_scales(buf, scales):
        keys = keys * scales.reshape(-1)[rows.clamp(min=0)][..., None]
    scores = torch.einsum("gqhd,ged->gqhe", q.float(), keys).relu() * scale
    scores = (scores * weights.float()[..., None]).sum(dim=2)
    seen = (rows >= 0)[:, None, :].expand_as(scores)
    if visible is not None:
        seen = seen & visible
    return scores.masked_fill(~seen, float("-inf"))
