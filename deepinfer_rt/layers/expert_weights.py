"""How routed experts that run in the engine dtype hold their weights, by checkpoint format: one choice for
layers/moe.py and DeepSeek-V4's experts (fp8.py and mxfp4.py hold the methods); and the joint tensors of routed and
shared experts that layers/moe.py's fused launches read."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.env import get_env
from deepinfer_rt.layers.fp8 import ExpertWeights, Fp8DequantExperts
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.mxfp4 import Mxfp4DequantExperts, Mxfp4FusedExperts


def expert_weights_method(config: KernelConfig) -> ExpertWeights:
    """How routed experts that run in the engine dtype hold their weights: MXFP4 (`expert_dtype: fp4`
    checkpoints) or FP8 blocks (FP8 checkpoints and Engine(quantization="fp8")) dequantized at load, else as
    loaded. layers/moe.py's RoutedExperts keep FP8 weights instead where `is_fp8_fused_experts`."""
    if config.quantization == "fp8" and config.is_checkpoint_quantized and config.expert_dtype == "fp4":
        return Mxfp4DequantExperts()
    if config.quantization == "fp8":
        return Fp8DequantExperts(config.weight_block_size, config.is_checkpoint_quantized, config.scale_fmt)
    return ExpertWeights()


def clamped_expert_weights_method(config: KernelConfig) -> ExpertWeights:
    """DeepSeek-V4 / V4.1's routed experts (deepseek_v4/moe.py ClampedExperts): MXFP4 checkpoints on CUDA (Triton,
    not batch-invariant) keep their experts 4-bit for the fused MXFP4 MoE, which the experts' forward then runs
    (`is_quantized`); else as expert_weights_method."""
    if (config.quantization == "fp8" and config.is_checkpoint_quantized and config.expert_dtype == "fp4"
            and config.is_triton and not config.is_batch_invariant):
        return Mxfp4FusedExperts(config.uses_pdl, get_env().mxfp4_fragment)
    return expert_weights_method(config)


def joint_expert_weights(experts: nn.Module, shared: nn.Module,
                         n_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (E + S, 2I, H), down (E + S, H, I)): the routed experts, then the shared MLP of width S * I as
    S experts of width I (its gate/up rows and down columns cut in S blocks). A token that takes those S
    experts with weight 1 gets the shared MLP's output: down(silu(gate x) * up x) sums over the width."""
    _, two_i, hidden = experts.gate_up_proj.shape
    inter = two_i // 2
    gate, up = shared.gate_up_proj.weight.data.view(2, n_shared, inter, hidden).unbind(0)
    shared_down = shared.down_proj.weight.data.view(hidden, n_shared, inter).transpose(0, 1)
    return (torch.cat([experts.gate_up_proj.data, torch.cat([gate, up], dim=1)]),
            torch.cat([experts.down_proj.data, shared_down]))


def joint_fp8_expert_weights(experts: nn.Module, shared: nn.Module, n_shared: int,
                             block: tuple[int, int]) -> tuple[torch.Tensor, ...] | None:
    """joint_expert_weights for FP8 experts and an FP8 shared MLP: (gate_up, its scales, down, its scales), the
    shared MLP cut in n_shared experts along its width together with its scale blocks; None where a cut would split
    a scale block (the width per expert not a multiple of the blocks, or the shared MLP's scales expanded per
    row), or where the shared MLP is not FP8."""
    _, two_i, hidden = experts.gate_up_proj.shape
    inter = two_i // 2
    bn, bk = block
    gate_up_layer, down_layer = shared.gate_up_proj, shared.down_proj
    if (inter % bn or inter % bk or gate_up_layer.weight.dtype != torch.float8_e4m3fn
            or getattr(gate_up_layer, "scale_group_n", None) != bn or getattr(down_layer, "scale_group_n", None) != bn
            or experts.gate_up_proj.dtype != torch.float8_e4m3fn):
        return None
    rows, cols = inter // bn, inter // bk
    gate, up = gate_up_layer.weight.data.view(2, n_shared, inter, hidden).unbind(0)
    gate_s, up_s = gate_up_layer.weight_scale_inv.data.view(2, n_shared, rows, -1).unbind(0)
    shared_down = down_layer.weight.data.view(hidden, n_shared, inter).transpose(0, 1)
    down_s = down_layer.weight_scale_inv.data.view(-1, n_shared, cols).transpose(0, 1)
    return (torch.cat([experts.gate_up_proj.data, torch.cat([gate, up], dim=1)]),
            torch.cat([experts.gate_up_proj_scale_inv.data, torch.cat([gate_s, up_s], dim=1)]),
            torch.cat([experts.down_proj.data, shared_down]),
            torch.cat([experts.down_proj_scale_inv.data, down_s]))
