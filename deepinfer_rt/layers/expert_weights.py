"""How routed experts that run in the engine dtype hold their weights, by checkpoint format: one choice for
layers/moe.py and DeepSeek-V4's experts (fp8.py and mxfp4.py hold the methods)."""
from __future__ import annotations

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
        return Mxfp4FusedExperts()
    return expert_weights_method(config)
