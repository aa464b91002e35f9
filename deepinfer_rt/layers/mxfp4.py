"""MXFP4 routed experts (DeepSeek-V4 / V4-Flash / V4.1 releases, `expert_dtype: fp4`), dequantized at load.

    experts.gate_up_proj             int8 (E, 2I, H/2) on disk: e2m1 pairs, gate's rows then up's
    experts.gate_up_proj_scale_inv   e8m0 (E, 2I, H/32): one power of two per 32 elements along K
    experts.down_proj                int8 (E, H, I/2)
    experts.down_proj_scale_inv      e8m0 (E, H, I/32)

(fused by layers/moe.py fuse_expert_weights from the per-expert `experts.E.w{1,3,2}.{weight,scale}`). The
weight loader unpacks the e2m1 codes into the layer's (E, N, K) parameter of the engine dtype -- every e2m1 value
is exact in bf16 -- and `process_weights_after_loading` multiplies in the scales in fp32, rounded once to the
engine dtype: the experts then run as 16/32-bit ones (CPU, batch-invariant mode: `Mxfp4DequantExperts`).

On CUDA (not batch-invariant) `Mxfp4FusedExperts` keeps them as loaded -- int8 codes and e8m0 bytes, 0.53 bytes
per element -- for the fused MXFP4 MoE (deepinfer_kernels.fused_moe_mxfp4), which dequantizes inside its GEMMs
(Hopper has no FP4 tensor cores); the dequantize-at-load path is its reference. With `fragment`
(DEEPINFER_MXFP4_FRAGMENT) the packed bytes are reordered at load, in place, into the order Hopper's wgmma takes
them from registers and into contiguous 64-row tiles, their scales into the same tiles
(deepinfer_kernels.fused_moe_mxfp4_frag: the same bytes, a cheaper decode, streamed reads), where the shapes allow;
`experts.mxfp4_fast` then says whether every scale byte allows its one-multiply decode (None: release order).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from deepinfer_rt.layers.fp8 import SCALE_SUFFIX, ExpertWeights
from deepinfer_rt.layers.quant_formats import EXPERT, MX_BLOCK, check_layout, decode_e8m0, role_layouts, unpack_e2m1

_LAYOUT = role_layouts((1, MX_BLOCK), "fp4")[EXPERT]


def _logical(scale: nn.Parameter) -> tuple[int, int, int]:
    """(experts, N, K) of the weight a (E, N, K/32) scale parameter belongs to: read from the parameter when
    it loads, so an EP rank's shard (distributed/ep.py, its own experts only) checks against its own shape."""
    e, n, groups = scale.shape
    return e, n, groups * MX_BLOCK


class Mxfp4DequantExperts(ExpertWeights):
    """Checks each fused tensor against the MXFP4 layout (dtype, packing, per-32 scales), naming it."""

    def create_weights(self, experts: nn.Module) -> None:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            e, n, k = weight.shape
            if k % MX_BLOCK:
                raise ValueError(f"experts.{name}: MXFP4 needs K a multiple of {MX_BLOCK}, the model has {k}")
            weight.weight_loader = functools.partial(self.load_weight, name)
            scale = nn.Parameter(torch.empty(e, n, k // MX_BLOCK, dtype=torch.float32), requires_grad=False)
            scale.weight_loader = functools.partial(self.load_scale, name)
            setattr(experts, name + SCALE_SUFFIX, scale)

    @staticmethod
    def load_weight(name: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
        e, n, k = param.shape
        if loaded.dtype != _LAYOUT.storage_dtype:
            raise ValueError(f"{loaded.dtype} expert weight where the checkpoint's quantization_config says "
                             f"expert_dtype 'fp4' ({_LAYOUT.format})")
        if tuple(loaded.shape) != (e, n, k // 2):
            raise ValueError(f"experts.{name}: packed shape {tuple(loaded.shape)} != {(e, n, k // 2)}, two e2m1 "
                             f"per byte of a {e}x{n}x{k} weight")
        param.data.copy_(unpack_e2m1(loaded))

    @staticmethod
    def load_scale(name: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_layout(f"experts.{name}", _LAYOUT, None, tuple(loaded.shape), _logical(param))
        param.data.copy_(decode_e8m0(loaded, f"experts.{name} scale"))

    @torch.no_grad()
    def process_weights_after_loading(self, experts: nn.Module) -> None:
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)
            scale = getattr(experts, name + SCALE_SUFFIX)
            if scale.shape[0] != w.shape[0]:
                raise ValueError(f"{name}: scales for {scale.shape[0]} experts, weights for {w.shape[0]} "
                                 "(a shard cut its weights and scales apart)")
            w.data = (w.data.float() * scale.data.float().repeat_interleave(MX_BLOCK, dim=-1)).to(w.dtype)
            setattr(experts, name + SCALE_SUFFIX, None)


class Mxfp4FusedExperts(ExpertWeights):
    """CUDA: the packed experts and their e8m0 bytes stay on the device for deepinfer_kernels.fused_moe_mxfp4.

        gate_up_proj int8 (E, 2I, H/2), gate_up_proj_scale_inv uint8 (E, 2I, H/32); down_proj likewise

    `apply(experts, x, weights, ids)` is the experts' forward (clamped SwiGLU at `experts.limit`); pdl: its GEMV
    form's launches programmatic dependent ones (KernelConfig.uses_pdl)."""

    is_quantized = True

    def __init__(self, pdl: bool = False, fragment: bool = False):
        self.pdl = pdl
        self.fragment = fragment  # DEEPINFER_MXFP4_FRAGMENT: the fragment order where the shapes allow

    def create_weights(self, experts: nn.Module) -> None:
        for name in ("gate_up_proj", "down_proj"):
            e, n, k = getattr(experts, name).shape
            if k % MX_BLOCK:
                raise ValueError(f"experts.{name}: MXFP4 needs K a multiple of {MX_BLOCK}, the model has {k}")
            packed = nn.Parameter(torch.empty(e, n, k // 2, dtype=torch.int8), requires_grad=False)
            packed.weight_loader = functools.partial(self.load_weight, name, k)
            setattr(experts, name, packed)
            scale = nn.Parameter(torch.empty(e, n, k // MX_BLOCK, dtype=torch.uint8), requires_grad=False)
            scale.weight_loader = functools.partial(self.load_scale, name)
            setattr(experts, name + SCALE_SUFFIX, scale)

    @staticmethod
    def load_weight(name: str, k: int, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"{loaded.dtype} expert weight where the checkpoint's quantization_config says "
                             f"expert_dtype 'fp4' ({_LAYOUT.format})")
        e, n, half = param.shape
        if tuple(loaded.shape) != (e, n, half):
            raise ValueError(f"experts.{name}: packed shape {tuple(loaded.shape)} != {(e, n, half)}, two e2m1 "
                             f"per byte of a {e}x{n}x{k} weight")
        param.data.copy_(loaded.view(torch.int8))

    @staticmethod
    def load_scale(name: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
        check_layout(f"experts.{name}", _LAYOUT, None, tuple(loaded.shape), _logical(param))
        s = decode_e8m0(loaded, f"experts.{name} scale")  # refuses NaN bytes and non-powers of two
        _, exp = torch.frexp(s)
        param.data.copy_((exp - 1 + 127).to(torch.uint8))

    def process_weights_after_loading(self, experts: nn.Module) -> None:
        for name in ("gate_up_proj", "down_proj"):
            if getattr(experts, name + SCALE_SUFFIX).shape[0] != getattr(experts, name).shape[0]:
                raise ValueError(f"{name}: scales and weights for different experts (a shard cut them apart)")
        if getattr(experts, "mxfp4_fast", None) is not None:
            return  # already in the fragment order (a module finalized twice must not be repacked twice)
        experts.mxfp4_fast = None  # the release order; else the fragment order and its decode (fused_moe_mxfp4_frag)
        gate_up = experts.gate_up_proj
        if self.fragment and gate_up.is_cuda and gate_up.shape[0]:
            from deepinfer_kernels import fused_moe_mxfp4_frag as frag

            hidden, inter = 2 * gate_up.shape[2], gate_up.shape[1] // 2
            if frag.fragment_supported(inter, hidden) and frag.fragment_supported(hidden, inter):
                for name in ("gate_up_proj", "down_proj"):
                    frag.repack_fragment(getattr(experts, name).data, out=getattr(experts, name).data)
                    scale = getattr(experts, name + SCALE_SUFFIX).data
                    frag.repack_scales(scale, out=scale)
                experts.mxfp4_fast = frag.fast_scales(experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv)

    def apply(self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        args = (experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj, experts.down_proj_scale_inv,
                weights, ids, experts.limit)
        if experts.mxfp4_fast is not None:
            from deepinfer_kernels.fused_moe_mxfp4_frag import fused_moe_mxfp4_frag

            # bf16 operands (an fp16 model's activations round to bf16 for this product)
            return fused_moe_mxfp4_frag(x.to(torch.bfloat16).contiguous(), *args, fast=experts.mxfp4_fast).to(x.dtype)
        from deepinfer_kernels.fused_moe_mxfp4 import fused_moe_mxfp4

        return fused_moe_mxfp4(x.contiguous(), *args, pdl=self.pdl)
