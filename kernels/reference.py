"""Torch reference ops: the simple path every fast kernel is checked against."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as the HF reference does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2d) = [gate | up] -> silu(gate) * up (..., d)."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """x (T, H, D), cos/sin (T, D) in the half-split layout [f0..f_{D/2-1}, f0..f_{D/2-1}].

    interleave=True: x's rotary dims come in adjacent pairs (x0, x1), (x2, x3)... (DeepSeek checkpoints);
    they are de-interleaved first, which gives the same result as rotating the pairs in place, in the
    half-split layout the HF reference returns.
    """
    if interleave:
        t, h, d = x.shape
        x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch form of deepinfer_kernels.fused_moe.moe_align: ids (T, k) -> (pair ids sorted by expert, each
    expert padded to block_m with the sentinel T*k; expert of each block; used padded rows, 1 element)."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    cnt_start = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    sorted_e = flat[order]
    dest = pad_end[sorted_e] - padded[sorted_e] + torch.arange(num_pairs, device=dev) - cnt_start[sorted_e]
    max_rows = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), pad_end[-1:]
