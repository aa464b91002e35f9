"""FP8 layer methods are chosen once from the KernelConfig (quantization, device, batch-invariant mode), and the
checkpoint's quantization_config is normalised once into QuantConfig; the block (de)quantization round-trips."""
from __future__ import annotations

import pytest
import torch

from deepinfer_kernels.dispatch import HAS_TRITON
from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks
from deepinfer_rt.config import QuantConfig
from deepinfer_rt.layers import methods
from deepinfer_rt.layers.fp8 import (ExpertWeights, Fp8BlockLinear, Fp8DequantExperts, Fp8DequantLinear,
                                     dense_linear_method, weight_linear_method)
from deepinfer_rt.layers.expert_weights import expert_weights_method
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
from deepinfer_rt.layers.linear import Linear
from deepinfer_rt.layers.moe import RoutedExperts

V3 = QuantConfig("fp8", (128, 128))


def test_method_selection():
    cpu, cuda = KernelConfig(), KernelConfig(device_type="cuda")
    assert weight_linear_method(cpu) is methods.linear_method(cpu)
    assert isinstance(expert_weights_method(cuda), ExpertWeights)
    assert not isinstance(expert_weights_method(cuda), Fp8DequantExperts)

    fp8_cpu, fp8_cuda = cpu.for_checkpoint(V3), cuda.for_checkpoint(V3)
    assert fp8_cpu.quantization == "fp8" and fp8_cpu.is_checkpoint_quantized
    assert isinstance(weight_linear_method(fp8_cpu), Fp8DequantLinear)
    assert isinstance(weight_linear_method(fp8_cuda), Fp8BlockLinear)
    assert isinstance(dense_linear_method(fp8_cuda), Fp8DequantLinear)  # MLA's kv_b
    assert isinstance(expert_weights_method(fp8_cuda), Fp8DequantExperts)
    invariant = KernelConfig(device_type="cuda", is_batch_invariant=True).for_checkpoint(V3)
    method = weight_linear_method(invariant)  # FP8 kept, the GEMM's one fixed tile
    assert isinstance(method, Fp8BlockLinear) and method.is_batch_invariant
    assert not weight_linear_method(fp8_cuda).is_batch_invariant
    kv_b = dense_linear_method(invariant)  # dequantized, then the invariant matmul
    assert isinstance(kv_b, Fp8DequantLinear) and isinstance(kv_b.inner, methods.InvariantLinear)
    online = KernelConfig.from_env("cpu", quantization="fp8")
    assert online.quantization == "fp8" and not online.is_checkpoint_quantized
    with pytest.raises(ValueError, match="quantization"):
        KernelConfig.from_env("cpu", quantization="int4")
    with pytest.raises(ValueError, match="quantization"):
        KernelConfig.from_env("cuda", quantization="int8")  # the weight-only int8 path is CPU-only


def test_quant_config_from_hf():
    assert QuantConfig.from_hf(None) is None
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert QuantConfig.from_hf(cfg) == V3
    assert QuantConfig.from_hf(dict(cfg, weight_block_size=[64, 32])).weight_block_size == (64, 32)
    for field, value in (("quant_method", "gptq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                         ("scale_fmt", "e4m3"), ("expert_dtype", "nvfp4"), ("weight_block_size", None)):
        with pytest.raises(ValueError, match=f"quantization_config.{field}"):
            QuantConfig.from_hf(dict(cfg, **{field: value}))


def test_block_quantization_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 200, 300, generator=g) * torch.logspace(-3, 1, 300)  # columns of very different sizes
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (3, 2, 3)
    assert q.float().abs().amax() == 448  # each block's amax maps onto e4m3's largest value
    err = (dequantize_fp8_blocks(q, s) - w).abs()
    block_amax = s.repeat_interleave(128, -2)[:, :200].repeat_interleave(128, -1)[..., :300] * 448
    assert (err <= block_amax / 16 + 1e-30).all()  # half an e4m3 step (3 mantissa bits) of the block's range
    assert torch.equal(quantize_fp8_blocks(torch.zeros(4, 4))[0].float(), torch.zeros(4, 4))


def test_layers_hold_fp8_parameters_and_keep_them_through_casts():
    with build_context(KernelConfig(device_type="cuda").for_checkpoint(V3)):
        linear = Linear(300, 200)
        experts = RoutedExperts(4, 256, 192)
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale_inv.shape == (2, 3)
    assert experts.gate_up_proj_scale_inv.shape == (4, 4, 2) and experts.down_proj_scale_inv.shape == (4, 2, 2)
    linear, experts = linear.to(torch.bfloat16), experts.to(torch.bfloat16)
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale_inv.dtype == torch.float32
    # Routed experts stay FP8 for the FP8 fused MoE where it runs (CUDA with Triton), else dequantize at load.
    kept = torch.float8_e4m3fn if HAS_TRITON else torch.bfloat16
    assert experts.gate_up_proj.dtype == kept and experts.gate_up_proj_scale_inv.dtype == torch.float32
    assert [n for n, _ in linear.named_parameters()] == ["weight", "weight_scale_inv"]
