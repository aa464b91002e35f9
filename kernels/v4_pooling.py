"""DeepSeek-V4's compressor pooling in Triton: per window and channel, softmax over the window's tokens of the
gate, then the weighted sum of the kv projections; one pass, fp32 throughout.

One program handles one window and a block of channels; the window (m tokens, 2m for CSA's overlapping pair)
fits one tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

BLOCK_C = 128
"""Channels per program."""


@triton.jit
def _pool_kernel(KV, Gate, Out, stride_kn, stride_km, stride_gn, stride_gm, stride_on, num_tokens, num_channels,
                 BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_m = tl.arange(0, BLOCK_M)
    cmask = offs_c < num_channels
    mask = (offs_m < num_tokens)[:, None] & cmask[None, :]
    gate = tl.load(Gate + n * stride_gn + offs_m[:, None] * stride_gm + offs_c[None, :], mask=mask,
                   other=float("-inf")).to(tl.float32)
    top = tl.max(gate, 0)
    e = tl.exp(gate - tl.where(top == float("-inf"), 0.0, top)[None, :])
    total = tl.sum(e, 0)
    w = e / tl.where(total == 0.0, 1.0, total)[None, :]
    kv = tl.load(KV + n * stride_kn + offs_m[:, None] * stride_km + offs_c[None, :], mask=mask, other=0.0)
    w = w.to(kv.dtype).to(tl.float32)  # the weights in kv's dtype, as the torch path multiplies them
    out = tl.sum(kv.to(tl.float32) * w, 0)
    tl.store(Out + n * stride_on + offs_c, out.to(Out.dtype.element_ty), mask=cmask)


def pool_window(kv: torch.Tensor, gate: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """kv (N, m, C), gate (N, m, C) fp32 (-inf = token left out) -> (N, C) in kv's dtype."""
    if kv.shape != gate.shape or kv.dim() != 3:
        raise ValueError(f"pool_window: kv {tuple(kv.shape)} and gate {tuple(gate.shape)} must be one (N, m, C)")
    n, m, c = kv.shape
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    out = torch.empty(n, c, dtype=kv.dtype, device=kv.device)
    if n == 0:
        return out
    _pool_kernel[(n, triton.cdiv(c, BLOCK_C))](kv, gate, out, kv.stride(0), kv.stride(1), gate.stride(0),
                                               gate.stride(1), out.stride(0), m, c,
                                               BLOCK_M=triton.next_power_of_2(m), BLOCK_C=BLOCK_C, num_warps=4,
                                               **pdl_launch(pdl))
    return out


@triton.jit
def _pool_half(Buf, slots, Ape, kv_col, gate_col, ape_col, offs_m, offs_c, mask, stride_b, stride_a, keep,
               HAS_APE: tl.constexpr):
    """One half of a window's tile: (BLOCK_M, BLOCK_C) gate + ape in fp32 (-inf where left out) and the kv values,
    from the pool rows `slots`, columns kv_col / gate_col on (ape_col of the bias)."""
    rows = Buf + slots.to(tl.int64)[:, None] * stride_b + offs_c[None, :]
    gate = tl.load(rows + gate_col, mask=mask, other=0.0).to(tl.float32)
    if HAS_APE:
        gate += tl.load(Ape + offs_m[:, None] * stride_a + ape_col + offs_c[None, :], mask=mask,
                        other=0.0).to(tl.float32)
    gate = tl.where(mask & keep, gate, float("-inf"))
    kv = tl.load(rows + kv_col, mask=mask, other=0.0)
    return gate, kv


@triton.jit
def _pool_gathered_kernel(Buf, Cur, Prev, HasPrev, Ape, Out, stride_b, stride_w, stride_a, stride_o, kv_col, gate_col,
                          num_tokens, num_channels, OVERLAP: tl.constexpr, HAS_APE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < num_tokens
    mask = mmask[:, None] & (offs_c < num_channels)[None, :]
    half = num_channels if OVERLAP else 0  # CSA: the window's own tokens give the second half of their columns
    cur = tl.load(Cur + n * stride_w + offs_m, mask=mmask, other=0)
    gate, kv = _pool_half(Buf, cur, Ape, kv_col + half, gate_col + half, half, offs_m, offs_c, mask, stride_b,
                          stride_a, True, HAS_APE)
    top = tl.max(gate, 0)
    if OVERLAP:  # and the previous window's tokens (none before window 0) the first half
        prev = tl.load(Prev + n * stride_w + offs_m, mask=mmask, other=0)
        gate_p, kv_p = _pool_half(Buf, prev, Ape, kv_col, gate_col, 0, offs_m, offs_c, mask, stride_b, stride_a,
                                  tl.load(HasPrev + n) != 0, HAS_APE)
        top = tl.maximum(top, tl.max(gate_p, 0))
    top = tl.where(top == float("-inf"), 0.0, top)
    e = tl.exp(gate - top[None, :])
    total = tl.sum(e, 0)
    if OVERLAP:
        e_p = tl.exp(gate_p - top[None, :])
        total += tl.sum(e_p, 0)
    total = tl.where(total == 0.0, 1.0, total)
    # The weights in the output's dtype (the torch forms': kv's, the pool's, or fp32 for an fp32 compressor)
    w = (e / total[None, :]).to(Out.dtype.element_ty).to(tl.float32)
    out = tl.sum(kv.to(tl.float32) * w, 0)
    if OVERLAP:
        w_p = (e_p / total[None, :]).to(Out.dtype.element_ty).to(tl.float32)
        out += tl.sum(kv_p.to(tl.float32) * w_p, 0)
    tl.store(Out + n * stride_o + offs_c, out.to(Out.dtype.element_ty), mask=offs_c < num_channels)


def pool_gathered(buf: torch.Tensor, kv_col: int, gate_col: int, cur: torch.Tensor, prev: torch.Tensor | None,
                  has_prev: torch.Tensor | None, ape: torch.Tensor | None, channels: int, overlap: bool,
                  out_dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    """pool_window over windows gathered from the pool in the same launch: buf (rows, cols) holds each token's kv
    projections from column kv_col and its gates from gate_col (width `channels`, or 2 x `channels` with
    `overlap`); cur / prev (N, m) the rows of each window's tokens and of the previous window's, has_prev (N,);
    ape (m, width) the gates' position bias (None: none). Without overlap a window pools its own m tokens; with
    overlap (CSA) the second half of its columns joins the first half of the previous window's (left out where
    has_prev is False), 2m tokens. -> (N, channels) in buf's dtype, or float32 (`out_dtype`: pool_window of the
    rows converted to fp32 first, V4.1's fp32 compressor)."""
    n, m = cur.shape
    width = (2 if overlap else 1) * channels
    out_dtype = out_dtype or buf.dtype
    if (buf.stride(-1) != 1 or out_dtype not in (buf.dtype, torch.float32)
            or (ape is not None and (ape.stride(-1) != 1 or tuple(ape.shape) != (m, width)))
            or (overlap and (prev is None or has_prev is None or prev.shape != cur.shape))):
        raise ValueError(f"pool_gathered: buf {tuple(buf.shape)} {buf.dtype} (unit column stride) into {out_dtype}, "
                         f"ape {None if ape is None else tuple(ape.shape)} for windows {tuple(cur.shape)} of width "
                         f"{width}, prev {None if prev is None else tuple(prev.shape)}")
    cur = cur.contiguous()
    prev = cur if prev is None else prev.contiguous()
    out = torch.empty(n, channels, dtype=out_dtype, device=buf.device)
    if n == 0:
        return out
    _pool_gathered_kernel[(n, triton.cdiv(channels, BLOCK_C))](
        buf, cur, prev, cur if has_prev is None else has_prev, buf if ape is None else ape, out, buf.stride(0),
        cur.stride(0), 0 if ape is None else ape.stride(0), out.stride(0), kv_col, gate_col, m, channels,
        OVERLAP=overlap, HAS_APE=ape is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_C=BLOCK_C, num_warps=4,
        **pdl_launch(pdl))
    return out
