"""DeepSeek-V4's compressor pooling in Triton: per window and channel, softmax over the window's tokens of the
gate, then the weighted sum of the kv projections; one pass, fp32 throughout.

One program handles one window and a block of channels; the window (m tokens, 2m for CSA's overlapping pair)
fits one tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 128
"""Channels per program."""


@triton.jit
def _pool_kernel(KV, Gate, Out, stride_kn, stride_km, stride_gn, stride_gm, stride_on, num_tokens, num_channels,
                 BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
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


def pool_window(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
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
                                               BLOCK_M=triton.next_power_of_2(m), BLOCK_C=BLOCK_C, num_warps=4)
    return out
