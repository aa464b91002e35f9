"""Gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_kernels.dispatch import on_gpu
from deepinfer_rt.layers import batch_invariant
from deepinfer_rt.layers.batch_invariant import silu_and_mul
from deepinfer_rt.layers.linear import Linear, MergedLinear


class GatedMLP(nn.Module):
    """HF names gate_proj/up_proj load into `gate_up_proj` through the model's packed_modules."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size})
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.is_enabled():
            return batch_invariant.gated_mlp(x, self.gate_up_proj.weight, self.down_proj.weight)
        h = self.gate_up_proj(x)
        if on_gpu(h) and h.dim() == 2 and not batch_invariant.is_enabled():
            from deepinfer_kernels.elementwise import silu_and_mul as silu_and_mul_gpu

            return self.down_proj(silu_and_mul_gpu(h))
        return self.down_proj(silu_and_mul(h))
