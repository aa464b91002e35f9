from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.methods import norm_method


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.method = norm_method(current_kernel_config())
        """Reference, fused Triton or batch-invariant (layers/methods.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), in one kernel on GPU."""
        return self.method.apply_add(self, x, residual)
