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
