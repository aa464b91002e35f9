"""Linear layers that own their weight loading.

`MergedLinear` fuses several HF projections (q/k/v, gate/up) into one matmul; each HF tensor is copied into
its row block by `weight_loader(param, tensor, shard_id)`, so checkpoint names stay the HF ones. The
product is the layer's method (layers/fp8.py weight_linear_method: layers/methods.py linear_method, or an FP8
method that adds its scale parameters through `create_weights`), chosen from the KernelConfig at construction.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.env import get_env
from deepinfer_rt.layers.fp8 import apply_keeping_quantized, check_fp8_weight, dense_linear_method, weight_linear_method
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.methods import LinearMethod


class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.method = method or weight_linear_method(current_kernel_config())
        self.method.create_weights(self, {None: out_features})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def _apply(self, fn, recurse=True):
        return apply_keeping_quantized(self, fn, lambda f: super(Linear, self)._apply(f, recurse))


class GroupedLinear(Linear):
    """A block-diagonal projection (V4's wo_a): `groups` groups of in_features inputs, each to out_features /
    groups outputs; the weight (out_features, in_features) holds group g's rows at [g * R, (g + 1) * R). Where
    the FP8 method runs grouped GEMMs (CUDA: Fp8BlockLinear.apply_grouped; DEEPINFER_FP8_GROUPED) the weight
    stays FP8; elsewhere it is dense (FP8 dequantized at load) and `project` hands it, as (groups, R,
    in_features), to the model method's grouped product."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        config = current_kernel_config()
        method = weight_linear_method(config)
        takes_groups = getattr(method, "takes_groups", None) if get_env().fp8_grouped else None
        if takes_groups is None or out_features % groups or not takes_groups(out_features // groups, in_features):
            method = dense_linear_method(config)
        super().__init__(in_features, out_features, method=method)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("GroupedLinear projects grouped inputs: project(x, product)")

    def project(self, x: torch.Tensor, product) -> torch.Tensor:
        """x (T, groups, in_features) -> (T, groups, R); product(x, w (groups, R, in_features)) on a dense weight."""
        if hasattr(self.method, "apply_grouped"):
            return self.method.apply_grouped(self, x)
        return product(x, self.weight.view(self.groups, -1, x.shape[-1]).to(x.dtype))


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 method: LinearMethod | None = None):
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.method = method or weight_linear_method(current_kernel_config())
        self.method.create_weights(self, shard_sizes)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        check_fp8_weight(param, loaded)
        start, size = self.shard_offsets[shard_id]
        want = (size, *param.shape[1:])
        if tuple(loaded.shape) != want:
            raise ValueError(f"shard {shard_id!r}: shape {tuple(loaded.shape)} != {want}")
        param.data[start : start + size].copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split([size for _, size in self.shard_offsets.values()], dim=-1)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def _apply(self, fn, recurse=True):
        return apply_keeping_quantized(self, fn, lambda f: super(MergedLinear, self)._apply(f, recurse))
