"""Weight-only int8 linears on CPU (Engine(quantization="int8")): per-output-row symmetric int8 weights, the
activations in the engine dtype, through torch's CPU int8 weight-pack matmul (aten._weight_int8pack_mm).

Quantized at load from the checkpoint's 16/32-bit weights: scale = max|row| / 127, q = round(w / scale). The
dense weight is dropped once quantized; `dequantized(layer)` gives the matrix the layer computes with (the
reference the tests and benchmark/bench_cpu_peers.py compare against). The GEMM is fast with bf16 activations
(oneDNN/AVX512); in fp32 it is correct but slow. Inputs of more than INT8_MM_MAX_ROWS rows take a dense GEMM over
the weight dequantized in the activation dtype (in bf16 that rounds q * scale to bf16), kept once made (env.py
DEEPINFER_CPU_DENSE_COPY).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.methods import LinearMethod, linear_method

INT8_MM_MAX_ROWS = 4
"""Inputs of more rows (prefill chunks, decode batches) multiply by the dequantized weight: the int8 matmul's
advantage is reading fewer weight bytes, which only pays while the GEMM is memory-bound. One thread, bf16, the
embedded default's gate_up (3072 x 576): int8 136 / 260 / 522 us at 1 / 4 / 8 rows against 306 / 358 / 381 us for
the dense GEMM (the 4-bit matmul crosses at the same point, layers/q4.py)."""


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q (N, K) int8, scale (N,) fp32) with weight ~ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class WeightOnlyLinear(LinearMethod):
    """A linear whose weight is kept quantized (int8 here, Q4_1 in layers/q4.py) and multiplied by torch's CPU
    weight-pack matmul for inputs of at most `max_rows` rows; larger inputs multiply by the weight dequantized for
    the call. Subclasses quantize in process_weights_after_loading and give `packed_mm` and `dense`."""

    is_quantized = True
    max_rows = INT8_MM_MAX_ROWS

    def packed_mm(self, layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def packed_fn(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """`packed_mm` bound to the layer's packed weight and scales as they are now, for activations in the dtype
        the scales were kept in (the model dtype): a step's hot loop calls it with no attribute lookups or casts."""
        return functools.partial(self.packed_mm, layer)

    def dense(self, layer: nn.Module) -> torch.Tensor:
        """The (N, K) fp32 matrix the layer multiplies by."""
        raise NotImplementedError

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise TypeError("a weight-only quantized linear computes through its own layer (apply), not a dense weight")

    def dense_in(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in `dtype`: made on the first call and kept (the same values every time), unless
        DEEPINFER_CPU_DENSE_COPY=0 (then made for each call: 10-15x the GEMM's time on the embedded default)."""
        kept = getattr(layer, "dense_copy", None)
        if kept is not None and kept.dtype == dtype:
            return kept
        from deepinfer_rt.env import get_env

        weight = self.dense(layer).to(dtype)
        if get_env().cpu_dense_copy:
            layer.dense_copy = weight
        return weight

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > self.max_rows:
            return torch.nn.functional.linear(x, self.dense_in(layer, x.dtype), layer.bias)
        y = self.packed_mm(layer, x2)
        if layer.bias is not None:
            y = y + layer.bias
        return y.view(*x.shape[:-1], y.shape[-1])


class Int8WeightOnlyLinear(WeightOnlyLinear):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dtype = layer.weight.dtype
        layer.int8_weight, scale = quantize_rows(layer.weight.data)
        layer.int8_scale = scale.to(dtype)
        # the decode-row kernels' form (models/llama_step.py): the scales the matmul uses, as fp32
        layer.int8_rows = (layer.int8_weight, layer.int8_scale.float().contiguous())
        layer.weight.data = layer.weight.data.new_empty(0)  # the dense copy is not kept

    def packed_mm(self, layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x2, layer.int8_weight, layer.int8_scale.to(x2.dtype))

    def packed_fn(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        weight, scale = layer.int8_weight, layer.int8_scale
        return lambda x2: torch.ops.aten._weight_int8pack_mm(x2, weight, scale)

    def dense(self, layer: nn.Module) -> torch.Tensor:
        return dequantized(layer)


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The (N, K) fp32 matrix an int8 layer multiplies by."""
    return layer.int8_weight.float() * layer.int8_scale.float()[:, None]


HEAD_MAX_ROWS = 4
"""Rows up to which the int8 head multiplies by its packed weight; beyond, the int8 matmul turns compute-bound on CPU
while the 16-bit GEMM over the dequantized head does not (benchmark/bench_cpu_peers.py)."""


class Int8Head(Int8WeightOnlyLinear):
    """The LM head of a weight-only quantized model (quantization="int8" or "q4_1"): per-row int8 as above. At batch
    1 the head is the largest matrix a step reads (a fifth of the embedded default's weights); the shipped GGUF keeps
    it in 8 bits too (Q8_0, the table its embedding lookups read).

    The dense weight stays: a tied head is the embedding table. Inputs of more than HEAD_MAX_ROWS rows multiply by the
    int8 weight dequantized in the model dtype (WeightOnlyLinear.dense_in: made on first use and kept)."""

    max_rows = HEAD_MAX_ROWS

    def prepare_head(self, layer: nn.Module) -> None:
        layer.int8_weight, scale = quantize_rows(layer.weight.data)
        layer.int8_scale = scale.to(layer.weight.dtype)


def head_method(config: KernelConfig) -> LinearMethod:
    """The LM head's method: int8 under the weight-only quantizations (Int8Head), else the config's."""
    return Int8Head() if config.quantization in ("int8", "q4_1") else linear_method(config)
