"""DeepSeek-V4's mHC residual mix projection in Triton: softmax of each token's (N, N) logits, then Sinkhorn-Knopp
normalisation (columns, then `iters - 1` rounds of rows and columns), all in one kernel instead of ~2 * iters
small torch ops per hyper-connection. fp32 throughout; one program handles BLOCK_T tokens.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

BLOCK_T = 16
"""Tokens per program."""


@triton.jit
def sinkhorn_tile(x, inside, iters, eps):
    """A (BLOCK_T, BLOCK_N, BLOCK_N) tile of logits, -inf outside the (N, N) `inside` -> the projected mixes."""
    top = tl.max(x, 2)
    top = tl.where(top == float("-inf"), 0.0, top)
    e = tl.exp(x - top[:, :, None])
    total = tl.sum(e, 2)
    comb = e / tl.where(total == 0.0, 1.0, total)[:, :, None] + eps
    comb = tl.where(inside[None, :, :], comb, 0.0)
    comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, 2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, 1)[:, None, :] + eps)
    return comb


@triton.jit
def _sinkhorn_kernel(Logits, Out, num_tokens, iters, eps, N: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_j = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_N)
    inside = (offs_j[:, None] < N) & (offs_k[None, :] < N)
    mask = (offs_t < num_tokens)[:, None, None] & inside[None, :, :]
    ptrs = offs_t.to(tl.int64)[:, None, None] * (N * N) + offs_j[None, :, None] * N + offs_k[None, None, :]
    x = tl.load(Logits + ptrs, mask=mask, other=float("-inf"))
    tl.store(Out + ptrs, sinkhorn_tile(x, inside, iters, eps), mask=mask)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, pdl: bool = False) -> torch.Tensor:
    """logits (T, N, N) -> (T, N, N) fp32: softmax over the last dim + eps, divided by its column sums + eps, then
    iters - 1 times by its row sums + eps and its column sums + eps."""
    if logits.dim() != 3 or logits.shape[1] != logits.shape[2]:
        raise ValueError(f"sinkhorn takes (T, N, N) logits, got {tuple(logits.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn needs at least one iteration, got {iters}")
    t, n, _ = logits.shape
    logits = logits.float().contiguous()
    out = torch.empty_like(logits)
    if t:
        _sinkhorn_kernel[(triton.cdiv(t, BLOCK_T),)](logits, out, t, iters, eps, N=n,
                                                     BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_T=BLOCK_T,
                                                     **pdl_launch(pdl))
    return out
