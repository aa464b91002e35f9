"""Layer methods: how a shared layer computes, chosen once from the KernelConfig when the layer is built.

As vLLM's `quant_method`, a layer keeps its method (`self.method = linear_method(config)`) and its forward calls
`self.method.apply(self, x)`; the device, batch-invariant mode and the environment knobs are decided in the
selectors below, never in a forward. A method may still dispatch on shapes (the skinny GEMM takes at most 16
rows). The MoE methods live in layers/moe.py, MLA's in layers/mla.py, DeepSeek-V4's in its package.

    linear_method(config)       UnquantizedLinear | SkinnyLinear (CUDA) | InvariantLinear (torch tiles / Triton)
    head_matmul_method(config)  HeadMatmul (einsum) | CudaHeadMatmul (bmm) | InvariantHeadMatmul
    activation_method(config)   Activation (reference) | TritonActivation | InvariantActivation
    norm_method(config)         RMSNormMethod (reference) | TritonRMSNorm (fused) | InvariantRMSNorm
    gated_mlp_method(config)    GatedMLPMethod | InvariantGatedMLP
    rope_method(config)         TorchRope | TritonRope (rotates in place)

A quantized linear is another LinearMethod (layers/fp8.py: Fp8BlockLinear, Fp8DequantLinear, chosen by
fp8.weight_linear_method for the layers that hold model weights): `create_weights(layer, shard_sizes)` adds its
weight and scale parameters (the unquantized methods keep nn.Linear's own weight) and
`process_weights_after_loading(layer)` brings them to the form `apply` runs.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer_kernels import reference
from deepinfer_rt.layers import batch_invariant, invariant_gemm
from deepinfer_rt.layers.kernel_config import KernelConfig


# ---- linear ----

class LinearMethod:
    """y = x @ weight.T + bias. `linear` takes the tensors (expert slices, routers); `apply` a layer's own."""

    is_batch_invariant = False
    is_quantized = False
    """Whether the layer's weight is held quantized (not a dense matrix other code may read)."""

    def create_weights(self, layer: nn.Module, shard_sizes: dict[str | None, int]) -> None:
        """Replace or add the layer's parameters (called once its nn.Linear weight exists)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, layer.weight, layer.bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


class UnquantizedLinear(LinearMethod):
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class SkinnyLinear(UnquantizedLinear):
    """CUDA: an x of at most 16 rows times a large weight takes the skinny GEMM kernel (DEEPINFER_SKINNY_GEMM);
    other shapes cuBLAS."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from deepinfer_kernels import skinny_gemm

        if skinny_gemm.supports(x, weight):
            return skinny_gemm.skinny_gemm(x, weight, bias)
        return F.linear(x, weight, bias)


class InvariantLinear(LinearMethod):
    """Each row computed the same way for any number of rows: fixed-shape torch tiles on CPU
    (layers/invariant_gemm.py), the fixed-tile Triton matmul on CUDA."""

    is_batch_invariant = True

    def __init__(self, is_triton: bool):
        self.is_triton = is_triton

    def mm(self, x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        """x (T, K) @ w_t (K, N)."""
        if self.is_triton:
            from deepinfer_kernels.batch_invariant import matmul

            return matmul(x, w_t)
        return invariant_gemm.tiled_mm(x, w_t)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.mm(x.reshape(-1, x.shape[-1]), weight.t())
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def linear_method(config: KernelConfig) -> LinearMethod:
    if config.is_batch_invariant:
        return InvariantLinear(config.is_triton)
    if config.is_triton and config.is_skinny_gemm:
        return SkinnyLinear()
    return UnquantizedLinear()


# ---- per-head matmul (MLA's absorbed projections) ----

class HeadMatmul:
    """x (T, H, A) @ w (H, A, B) -> (T, H, B)."""

    def apply(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("tha,hab->thb", x, w)


class CudaHeadMatmul(HeadMatmul):
    def apply(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return super().apply(x, w)  # (bmm's out= form does not take autograd inputs)
        # cuBLAS writes the (T, H, B) result through its strides (batch stride B, row stride H * B), where
        # einsum's (H, T, B) result would need a transposing copy before the projection that reads it.
        out = x.new_empty(x.shape[0], w.shape[0], w.shape[2])
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out


class InvariantHeadMatmul(HeadMatmul):
    def __init__(self, is_triton: bool):
        self.is_triton = is_triton

    def apply(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.is_triton:
            from deepinfer_kernels.batch_invariant import head_matmul

            return head_matmul(x, w)
        return batch_invariant.head_matmul(x, w)


@functools.cache
def head_matmul_method(config: KernelConfig) -> HeadMatmul:
    if config.is_batch_invariant:
        return InvariantHeadMatmul(config.is_triton)
    return CudaHeadMatmul() if config.device_type == "cuda" else HeadMatmul()


# ---- activations ----

class Activation:
    """silu_and_mul (x (..., 2d) = [gate | up] -> silu(gate) * up) and sigmoid."""

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return reference.silu_and_mul(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return x.sigmoid()


class TritonActivation(Activation):
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return reference.silu_and_mul(x)
        from deepinfer_kernels.elementwise import silu_and_mul

        return silu_and_mul(x)


class InvariantActivation(Activation):
    def __init__(self, is_triton: bool):
        self.is_triton = is_triton

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_triton:
            from deepinfer_kernels.batch_invariant import silu_and_mul

            return silu_and_mul(x)
        return batch_invariant.silu_and_mul(x)

    def sigmoid(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant.sigmoid(x)


@functools.cache
def activation_method(config: KernelConfig) -> Activation:
    if config.is_batch_invariant:
        return InvariantActivation(config.is_triton)
    return TritonActivation() if config.is_triton else Activation()


# ---- RMSNorm ----

class RMSNormMethod:
    """norm(x) and (norm(x + residual), x + residual) for an RMSNorm layer (weight, eps)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return reference.rms_norm(x, weight, eps)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x, layer.weight, layer.eps)

    def apply_add(self, layer: nn.Module, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + residual
        return self.rms_norm(s, layer.weight, layer.eps), s


class TritonRMSNorm(RMSNormMethod):
    """The fused Triton kernel (residual add included) for 2-D inputs it takes; others the reference. pdl: its
    launches programmatic dependent ones (KernelConfig.uses_pdl)."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(-1) == 1:
            from deepinfer_kernels.elementwise import rms_norm

            return rms_norm(x, layer.weight, layer.eps, pdl=self.pdl)
        return super().apply(layer, x)

    def apply_add(self, layer: nn.Module, x: torch.Tensor,
                  residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dim() == 2 and x.is_contiguous() and residual.is_contiguous():
            from deepinfer_kernels.elementwise import rms_norm

            return rms_norm(x, layer.weight, layer.eps, residual, pdl=self.pdl)
        return super().apply_add(layer, x, residual)


class InvariantRMSNorm(RMSNormMethod):
    def __init__(self, is_triton: bool):
        self.is_triton = is_triton

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.is_triton:
            from deepinfer_kernels.batch_invariant import rms_norm

            return rms_norm(x, weight, eps)
        return batch_invariant.rms_norm(x, weight, eps)


@functools.cache
def norm_method(config: KernelConfig) -> RMSNormMethod:
    if config.is_batch_invariant:
        return InvariantRMSNorm(config.is_triton)
    return TritonRMSNorm(config.uses_pdl) if config.is_triton else RMSNormMethod()


# ---- gated MLP ----

class GatedMLPMethod:
    """down(silu(gate x) * up x) through the layer's own projections and the config's activation."""

    def __init__(self, activation: Activation):
        self.activation = activation

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return layer.down_proj(self.activation.silu_and_mul(layer.gate_up_proj(x)))


class InvariantGatedMLP(GatedMLPMethod):
    """CPU: the columns form (batch_invariant.gated_mlp); CUDA: the invariant Triton GEMMs and activation."""

    def __init__(self, activation: Activation, linear: InvariantLinear):
        super().__init__(activation)
        self.linear = linear

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = layer.gate_up_proj.weight, layer.down_proj.weight
        if self.linear.is_triton:
            return self.linear.linear(self.activation.silu_and_mul(self.linear.linear(x, gate_up)), down)
        return batch_invariant.gated_mlp(x, gate_up, down)


@functools.cache
def gated_mlp_method(config: KernelConfig) -> GatedMLPMethod:
    if config.is_batch_invariant:
        return InvariantGatedMLP(activation_method(config), linear_method(config))
    return GatedMLPMethod(activation_method(config))


# ---- rotary embedding ----

class TorchRope:
    """Rotates into new tensors (cos/sin computed from the positions, as the HF reference)."""

    def is_in_place(self, *xs: torch.Tensor) -> bool:
        """Whether `apply` rotates these xs in place rather than returning new tensors."""
        return False

    def apply(self, layer: nn.Module, positions: torch.Tensor,
              xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        cos, sin = layer.cos_sin(positions, xs[0].dtype)
        return tuple(reference.apply_rope(x, cos, sin, layer.interleave) for x in xs)


class TritonRope(TorchRope):
    """Rotates in place with the Triton kernel over the layer's shared cos/sin tables, where the xs' last dim
    is contiguous."""

    def is_in_place(self, *xs: torch.Tensor) -> bool:
        return all(x.stride(-1) == 1 for x in xs)

    def apply(self, layer: nn.Module, positions: torch.Tensor,
              xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        if not self.is_in_place(*xs):
            return super().apply(layer, positions, xs)
        from deepinfer_kernels.elementwise import apply_rope_

        cos, sin = layer.tables(positions.device)
        return tuple(apply_rope_(x, positions, cos, sin, layer.interleave) for x in xs)


@functools.cache
def rope_method(config: KernelConfig) -> TorchRope:
    return TritonRope() if config.is_triton else TorchRope()

