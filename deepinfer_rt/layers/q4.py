"""Weight-only 4-bit linears on CPU in GGUF's Q4_1 layout (Engine(quantization="q4_1")).

Q4_1, as llama.cpp defines it: each row is cut into blocks of 32 weights along K; a block keeps d = (max - min) / 15
and m = min, both stored as float16, and one 4-bit code per weight, q = min(15, trunc((w - min) / d + 0.5)),
computed with the float32 d and min; the weight it stands for is fp16(d) * q + fp16(m).

The embedded default ships as a Q4_1 GGUF, and its converted checkpoint holds exactly those dequantized values:
quantizing them again by the same rule gives back the file's codes and scales bit for bit (each block's minimum
and maximum are among its dequantized values), so quantization="q4_1" on the embedded default computes with the
shipped weights (test/e2e/test_cpu_q4.py checks every Q4_1 tensor of the file).

The GEMM is torch's CPU int4 weight-pack matmul (aten._weight_int4pack_mm_for_cpu), which computes
(q - 8) * scale + zero per group: scale = d, zero = m + 8 d, in the activation dtype (bf16 rounds fp16 scales).
Inputs of more than Q4_MM_MAX_ROWS rows multiply by the dequantized weight, kept once made, as layers/int8.py does.

The CPU step's decode rows (models/llama_step.py) take the decode-row kernels instead (kernels/cpu/row_decode.cpp):
they read each layer's codes packed as GGUF packs them, with d and m - 16 d in fp32 (`kernel_rows`), and multiply
by the dequantized values in fp32 sums.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepinfer_rt.layers.int8 import WeightOnlyLinear

GROUP = 32
Q4_MM_MAX_ROWS = 4
"""Past 4 rows the 4-bit matmul is compute-bound and the dense GEMM wins: one thread, bf16, gate_up (3072 x 576):
114 / 216 / 362 / 866 us at 1 / 4 / 6 / 16 rows against 273 / 300 / 300 / 337 us."""


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float, K a multiple of 32 -> (codes (N, K) uint8 in 0..15, d (N, K/32) fp16, m (N, K/32) fp16)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"Q4_1 needs the input dimension to be a multiple of {GROUP}, got {k}")
    w = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    codes = ((w - lo[..., None]) * inv[..., None] + 0.5).trunc().clamp_(0, 15).to(torch.uint8)
    return codes.view(n, k), d.half(), lo.half()


def kernel_rows(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 weight in the form the CPU decode-row kernels read (kernels/cpu/row_decode.cpp, `q4_gemv`,
    `decode_layer_q4`): codes packed two to a byte as GGUF packs a block (byte j of a block: code j in the low
    nibble, code j + 16 in the high one), d as fp32, and c = m - 16 d in fp32 (the kernels sum (16 + q) * x per
    block: the codes 16 + q are exact bf16 values)."""
    n, k = codes.shape
    blocks = codes.view(n, k // GROUP, 2, GROUP // 2)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scale = d.float().contiguous()
    return packed, scale, (m.float() - 16 * scale).contiguous()


def dequantize_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The (N, K) float32 matrix a Q4_1 weight stands for."""
    n, k = codes.shape
    w = codes.view(n, k // GROUP, GROUP).float() * d.float()[..., None] + m.float()[..., None]
    return w.view(n, k)


class Q4WeightOnlyLinear(WeightOnlyLinear):
    max_rows = Q4_MM_MAX_ROWS

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        codes, d, m = quantize_q4_1(layer.weight.data)
        layer.q4_codes, layer.q4_d, layer.q4_m = codes, d, m
        layer.q4_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        # (K/32, N, 2): per group and output row, [scale, zero] of (q - 8) * scale + zero, in the model dtype (the
        # activations' dtype: converting them at each call cost as much as the 4-bit matmul itself).
        scales_zeros = torch.stack([d.float(), m.float() + 8 * d.float()], dim=-1).transpose(0, 1).contiguous()
        layer.q4_scales_zeros = scales_zeros.to(layer.weight.dtype)
        layer.q4_rows = kernel_rows(codes, d, m)  # the decode-row kernels' form (models/llama_step.py)
        layer.weight.data = layer.weight.data.new_empty(0)  # the dense copy is not kept

    def packed_mm(self, layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.q4_packed, GROUP, layer.q4_scales_zeros.to(x2.dtype))

    def packed_fn(self, layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        packed, scales_zeros = layer.q4_packed, layer.q4_scales_zeros
        return lambda x2: torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, GROUP, scales_zeros)

    def dense(self, layer: nn.Module) -> torch.Tensor:
        return dequantized(layer)


def dequantized(layer: nn.Module) -> torch.Tensor:
    """The (N, K) fp32 matrix a Q4_1 layer multiplies by."""
    return dequantize_q4_1(layer.q4_codes, layer.q4_d, layer.q4_m)
