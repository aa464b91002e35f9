from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels.dispatch import on_gpu
from deepinfer_rt.layers import batch_invariant
from deepinfer_rt.layers.batch_invariant import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if on_gpu(x) and x.dim() == 2 and x.stride(-1) == 1 and not batch_invariant.is_enabled():
            from deepinfer_kernels.elementwise import rms_norm as rms_norm_gpu

            return rms_norm_gpu(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one kernel on GPU."""
        if (on_gpu(x) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
                and not batch_invariant.is_enabled()):
            from deepinfer_kernels.elementwise import rms_norm as rms_norm_gpu

            return rms_norm_gpu(x, self.weight, self.eps, residual)
        s = x + residual
        return rms_norm(s, self.weight, self.eps), s
