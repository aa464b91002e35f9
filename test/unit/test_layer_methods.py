"""Layer methods are chosen once, from the KernelConfig, when a layer is built; no layer or model forward tests the
device, queries a global mode or reads the environment (STYLE.md item 16)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch
from torch import nn

import deepinfer_rt.layers
import deepinfer_rt.models
from deepinfer_rt.layers import methods
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context, current_kernel_config

FORBIDDEN = ("is_enabled(", "on_gpu(", "is_cuda", "get_env(", ".device.type")


def _modules(package) -> list:
    found = [package]
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        found.append(importlib.import_module(info.name))
    return found


def _layer_classes() -> list[type]:
    classes = {}
    for module in _modules(deepinfer_rt.layers) + _modules(deepinfer_rt.models):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, nn.Module) and cls.__module__.startswith(("deepinfer_rt.layers", "deepinfer_rt.models")):
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [classes[k] for k in sorted(classes)]


def test_layer_forwards_hold_no_mode_tests():
    classes = _layer_classes()
    assert len(classes) > 20  # the walk found the layers (MLAttention, MoE, V4Attention, ...)
    offenders = []
    for cls in classes:
        for name, fn in vars(cls).items():
            if not (name == "forward" or name.startswith("forward_")) or not callable(fn):
                continue
            source = inspect.getsource(fn)
            offenders += [f"{cls.__module__}.{cls.__qualname__}.{name}: {bad}" for bad in FORBIDDEN if bad in source]
    assert not offenders, offenders


def test_default_config_is_cpu_not_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MLA_MHA_PREFILL", "1")
    monkeypatch.setenv("DEEPINFER_MOE_ROUTER_SKEW", "0.5")
    config = current_kernel_config()
    assert config.device_type == "cpu" and not config.is_batch_invariant and not config.is_triton
    assert config.mla_mha_prefill is True and config.moe_router_skew == 0.5
    assert config.mla_prefix_split is None  # unset: the layer decides per chunk
    monkeypatch.setenv("DEEPINFER_MLA_PREFIX_SPLIT", "0")
    assert current_kernel_config().mla_prefix_split is False
    with pytest.raises(Exception):
        config.is_batch_invariant = True  # frozen


@pytest.mark.parametrize("device_type,is_invariant", [("cpu", False), ("cpu", True), ("cuda", False), ("cuda", True)])
def test_layers_take_their_methods_at_construction(device_type, is_invariant):
    from deepinfer_kernels.dispatch import HAS_TRITON
    from deepinfer_rt.layers.linear import Linear
    from deepinfer_rt.layers.mlp import GatedMLP
    from deepinfer_rt.layers.moe import FusedExperts, RoutedExperts, TorchExperts
    from deepinfer_rt.layers.norm import RMSNorm

    config = KernelConfig(device_type=device_type, is_batch_invariant=is_invariant)
    with build_context(config):
        linear, norm, mlp, experts = Linear(4, 4), RMSNorm(4, 1e-6), GatedMLP(4, 8), RoutedExperts(2, 4, 8)
    assert current_kernel_config() == KernelConfig.from_env()  # the scope ended
    is_triton = device_type == "cuda" and HAS_TRITON
    if is_invariant:
        assert isinstance(linear.method, methods.InvariantLinear) and linear.method.is_triton == is_triton
        assert isinstance(norm.method, methods.InvariantRMSNorm)
        assert isinstance(mlp.method, methods.InvariantGatedMLP)
    else:
        assert type(linear.method) is (methods.SkinnyLinear if is_triton else methods.UnquantizedLinear)
        assert type(norm.method) is (methods.TritonRMSNorm if is_triton else methods.RMSNormMethod)
        assert type(mlp.method) is methods.GatedMLPMethod
    assert isinstance(experts.method, FusedExperts if is_triton else TorchExperts)
    with build_context(KernelConfig()):
        assert type(Linear(4, 4).method) is methods.UnquantizedLinear


def test_invariant_model_layers_compute_invariant_forms():
    """A GatedMLP built for batch-invariant CPU runs the invariant columns form (bitwise), the default one the
    plain ops (close)."""
    from deepinfer_rt.layers import batch_invariant
    from deepinfer_rt.layers.mlp import GatedMLP

    torch.manual_seed(0)
    with build_context(KernelConfig(is_batch_invariant=True)):
        invariant = GatedMLP(16, 32)
    plain = GatedMLP(16, 32)
    plain.load_state_dict(invariant.state_dict())
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = batch_invariant.gated_mlp(x, invariant.gate_up_proj.weight, invariant.down_proj.weight)
        assert torch.equal(invariant(x), expected)
        torch.testing.assert_close(plain(x), expected, rtol=1e-5, atol=1e-6)
