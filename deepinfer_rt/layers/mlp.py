"""Gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import Linear, MergedLinear
from deepinfer_rt.layers.methods import gated_mlp_method


class GatedMLP(nn.Module):
    """HF names gate_proj/up_proj load into `gate_up_proj` through the model's packed_modules."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.method = gated_mlp_method(current_kernel_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)
