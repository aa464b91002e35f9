"""Linear layers that own their weight loading.

`MergedLinear` fuses several HF projections (q/k/v, gate/up) into one matmul; each HF tensor is copied into
its row block by `weight_loader(param, tensor, shard_id)`, so checkpoint names stay the HF ones. The
product is the layer's method (layers/methods.py linear_method), chosen from the KernelConfig at construction.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.methods import linear_method


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.method = linear_method(current_kernel_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.method = linear_method(current_kernel_config())
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        start, size = self.shard_offsets[shard_id]
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split([size for _, size in self.shard_offsets.values()], dim=-1)
