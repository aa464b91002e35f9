"""Block-scaled FP8 weights (DeepSeek-V3/R1/V3.1 release format, Engine(quantization="fp8")): the linear and
routed-expert methods for KernelConfig.quantization == "fp8".

    <name>.weight            float8_e4m3fn (N, K)
    <name>.weight_scale_inv  float32 (ceil(N/bn), ceil(K/bk)): dequantized weight = value x its block's scale

A merged layer (fused_qkv_a_proj, gate_up_proj) keeps each HF shard's scale rows as that shard's own blocks, one
after another (`scale_offsets`): the layout of the merged weight's blocks when every shard but the last starts on
a block boundary (V3's), and still correct when one does not (q_lora_rank = 192 with 128-row blocks). Fused
routed experts (E, N, K) keep (E, ceil(N/bn), ceil(K/bk)) per projection, gate's then up's for gate_up.

    Fp8BlockLinear    CUDA: float8 weights + scales on the device, the W8A8 block GEMM (deepinfer_kernels.fp8_gemm;
                      DEEPINFER_FP8_GEMM picks its path; batch-invariant mode one fixed tile); activations quantized
                      per token and bk-channel group
    Fp8DequantLinear  elsewhere (CPU, MLA's kv_b whose per-head slices feed the absorbed
                      matmuls): dequantized once at load to the engine dtype, fp32 math of value x scale, rounded
                      once; then the unquantized method it wraps runs
    Fp8BlockExperts   routed experts (layers/moe.py) on CUDA: float8 + scales for the FP8 fused MoE
                      (deepinfer_kernels.fused_moe_fp8, W8A8; batch-invariant mode one fixed configuration)
    Fp8DequantExperts routed experts elsewhere, and DeepSeek-V4's (its own expert loop): dequantized at load

With a 16/32-bit checkpoint (Engine(quantization="fp8"), load_format="dummy") the weights load as they are and
`process_weights_after_loading` quantizes them, per shard, as scripts/quantize_checkpoint.py would; the dequant
methods then hold the dequantized FP8 values, so CPU runs see the FP8 model's weights.

Float8 weights and float32 scales keep their dtypes through a module's `.to(dtype)` (`apply_keeping_quantized`).
Scales in e8m0 (`scale_fmt: ue8m0`, the V4 / V4.1 releases: layers/quant_formats.py) are decoded to float32 as
they load, so every method here runs on float32 block scales whatever the checkpoint's encoding; MXFP4 routed
experts are layers/mxfp4.py's.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks
from deepinfer_rt.env import get_env
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.methods import LinearMethod, linear_method
from deepinfer_rt.layers.quant_formats import read_scale

SCALE_SUFFIX = "_scale_inv"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def apply_keeping_quantized(module: nn.Module, fn: Callable, apply: Callable) -> nn.Module:
    """`module._apply(fn)` through `apply` (nn.Module's), except that float8 parameters and float32 scales
    (`*_scale_inv`) only follow device moves: a model cast to bf16 keeps its FP8 weights and exact scales."""
    kept = {n: p for n, p in module._parameters.items()
            if p is not None and (p.dtype == torch.float8_e4m3fn or n.endswith(SCALE_SUFFIX))}
    for n in kept:
        module._parameters[n] = None  # skipped by nn.Module._apply, and the order of parameters is kept
    try:
        apply(fn)
    finally:
        device = fn(torch.empty(0)).device
        for n, p in kept.items():
            p.data = p.data.to(device)
            module._parameters[n] = p
    return module


def check_fp8_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """An FP8 checkpoint's weight must come as float8 (with its scale): a 16/32-bit one would be taken unscaled."""
    if getattr(param, "is_fp8_checkpoint", False) and loaded.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{loaded.dtype} weight where the checkpoint's quantization_config says float8_e4m3fn")


def load_fp8_weight(param: nn.Parameter, loaded: torch.Tensor) -> None:
    check_fp8_weight(param, loaded)
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded)


def _scale_param(rows: int, cols: int, leading: tuple[int, ...] = ()) -> nn.Parameter:
    return nn.Parameter(torch.empty(*leading, rows, cols, dtype=torch.float32), requires_grad=False)


class Fp8LinearMethod(LinearMethod):
    """What both FP8 linear methods share: the scale parameter and its loader, and the per-shard (de)quantization.

    `create_weights(layer, shard_sizes)` is called by the layer once its nn.Linear weight exists; shard_sizes are
    the HF projections' output rows in order (one unnamed shard for a plain Linear)."""

    def __init__(self, block: tuple[int, int], is_checkpoint_quantized: bool, scale_fmt: str = "float32"):
        self.block = block
        self.is_checkpoint_quantized = is_checkpoint_quantized
        self.scale_fmt = scale_fmt

    weight_dtype: torch.dtype | None = None
    """The dtype the checkpoint's FP8 weight is held in until processed: float8 or, None, the layer's own (an
    exact copy of the fp8 values)."""

    def create_weights(self, layer: nn.Module, shard_sizes: dict[str | None, int]) -> None:
        bn, bk = self.block
        layer.shard_rows, layer.scale_offsets = {}, {}
        row = scale_row = 0
        for shard, size in shard_sizes.items():
            layer.shard_rows[shard] = (row, size)
            layer.scale_offsets[shard] = (scale_row, _cdiv(size, bn))
            row, scale_row = row + size, scale_row + _cdiv(size, bn)
        if not self.is_checkpoint_quantized:
            return  # the weight loads in 16/32-bit; process_weights_after_loading quantizes it
        if self.weight_dtype is not None:
            layer.weight = nn.Parameter(torch.empty_like(layer.weight, dtype=self.weight_dtype), requires_grad=False)
        layer.weight.is_fp8_checkpoint = True  # loaders refuse a 16/32-bit tensor for it (check_fp8_weight)
        layer.weight.weight_loader = load_fp8_weight  # a merged layer replaces it by its shard loader
        layer.weight_scale_inv = _scale_param(scale_row, _cdiv(layer.in_features, bk))
        layer.weight_scale_inv.weight_loader = functools.partial(self.load_scale, layer)

    def load_scale(self, layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """Copy one HF projection's `weight_scale_inv` into its shard's scale rows (e8m0 decoded), refusing
        another shape."""
        loaded = read_scale(loaded, self.scale_fmt)
        start, rows = layer.scale_offsets[shard]
        _, size = layer.shard_rows[shard]
        want = (rows, param.shape[1])
        if tuple(loaded.shape) != want:
            derived = ""
            if loaded.dim() == 2 and min(loaded.shape) > 0:
                derived = (f" (the scale grid derives {_cdiv(size, loaded.shape[0])}x"
                           f"{_cdiv(layer.in_features, loaded.shape[1])} blocks)")
            raise ValueError(f"scale shape {tuple(loaded.shape)} != {want}, the {self.block[0]}x{self.block[1]} "
                             f"blocks of a {size}x{layer.in_features} weight{derived}")
        param.data[start : start + rows].copy_(loaded)

    def shards(self, layer: nn.Module):
        """(weight rows, scale rows) slice pairs, one per shard."""
        for shard, (start, size) in layer.shard_rows.items():
            s_start, s_rows = layer.scale_offsets[shard]
            yield slice(start, start + size), slice(s_start, s_start + s_rows)

    def quantize(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's 16/32-bit weight as (float8 weight, per-shard scales)."""
        w = layer.weight.data
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
        scales = []
        for rows, _ in self.shards(layer):
            q[rows], s = quantize_fp8_blocks(w[rows], self.block)
            scales.append(s)
        return q, torch.cat(scales)


class Fp8DequantLinear(Fp8LinearMethod):
    """FP8 weights dequantized at load; `inner` (the unquantized method of the config) runs the matmuls."""

    def __init__(self, block: tuple[int, int], is_checkpoint_quantized: bool, inner: LinearMethod,
                 scale_fmt: str = "float32"):
        super().__init__(block, is_checkpoint_quantized, scale_fmt)
        self.inner = inner
        self.is_batch_invariant = inner.is_batch_invariant

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.linear(x, weight, bias)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight.data
        if self.is_checkpoint_quantized:
            q, scale = w, layer.weight_scale_inv.data
        else:
            q, scale = self.quantize(layer)
        dense = torch.empty_like(w)
        for rows, scale_rows in self.shards(layer):
            dense[rows] = dequantize_fp8_blocks(q[rows], scale[scale_rows], self.block, w.dtype)
        layer.weight.data = dense
        layer.weight_scale_inv = None


def fp8_gemm_path(path: str) -> str:
    """`path` (DEEPINFER_FP8_GEMM) checked: one of deepinfer_kernels.fp8_gemm.FP8_GEMM_PATHS, and for
    'scaled_mm' a torch build that has the block-scaled API (the device is probed at the first GEMM)."""
    from deepinfer_kernels.fp8_gemm import FP8_GEMM_PATHS, scaled_mm_api_missing

    if path not in FP8_GEMM_PATHS:
        raise ValueError(f"DEEPINFER_FP8_GEMM={path!r}: not one of {', '.join(FP8_GEMM_PATHS)}")
    missing = scaled_mm_api_missing() if path == "scaled_mm" else None
    if missing is not None:
        raise ValueError(f"DEEPINFER_FP8_GEMM=scaled_mm: {missing}")
    return path


class Fp8BlockLinear(Fp8LinearMethod):
    """CUDA: float8 weight and float32 block scales on the device, a block-scaled FP8 GEMM (`gemm_path`, from
    DEEPINFER_FP8_GEMM: deepinfer_kernels.fp8_gemm.fp8_gemm's paths). Where a merged layer's shard starts inside
    a row block, the scales are expanded to one row per weight row (GROUP_N = 1). pdl: the fused path's launches
    as programmatic dependent ones (KernelConfig.uses_pdl)."""

    weight_dtype = torch.float8_e4m3fn
    is_quantized = True

    def __init__(self, block: tuple[int, int], is_checkpoint_quantized: bool, scale_fmt: str = "float32",
                 gemm_path: str = "auto", is_batch_invariant: bool = False, split_sum: str = "kernel",
                 pdl: bool = False, split_rows: int | None = None):
        from deepinfer_kernels.fp8_gemm import SPLIT_K_MAX_ROWS, SPLIT_SUMS

        super().__init__(block, is_checkpoint_quantized, scale_fmt)
        self.gemm_path = fp8_gemm_path(gemm_path)
        self.is_batch_invariant = is_batch_invariant
        if split_sum not in SPLIT_SUMS:
            raise ValueError(f"DEEPINFER_FP8_SPLIT_SUM={split_sum!r}: not one of {SPLIT_SUMS}")
        self.split_sum = split_sum
        self.pdl = pdl
        self.split_rows = SPLIT_K_MAX_ROWS if split_rows is None else split_rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError("Fp8BlockLinear runs a layer's own weights and scales (apply)")

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from deepinfer_kernels.fp8_gemm import fp8_gemm, fp8_invariant_gemm

        if self.is_batch_invariant:  # one tile whatever the batch (DEEPINFER_FP8_GEMM does not apply)
            return fp8_invariant_gemm(x, layer.weight, layer.weight_scale_inv, layer.scale_group_n, self.block[1],
                                      layer.bias)
        return fp8_gemm(x, layer.weight, layer.weight_scale_inv, layer.scale_group_n, self.block[1], layer.bias,
                        self.gemm_path, self.split_sum, self.pdl, split_rows=self.split_rows)

    def takes_groups(self, rows: int, in_features: int) -> bool:
        """Whether apply_grouped runs groups of `rows` output rows over `in_features` inputs each: 128 x 128 blocks,
        rows a multiple of 16 (an N tile within one group) and in_features of 128 (each group's own activation
        scales). At 32 x 32 blocks (V4.1) the grouped FP8 GEMM was slower than bf16 on the dequantized weight at
        every row count measured (H100, V4.1-Flash's wo_a: 33-103 µs against 25-35 at 1-256 rows), so such
        weights stay dequantized."""
        return self.block == (128, 128) and rows % 16 == 0 and in_features % 128 == 0

    def apply_grouped(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (T, G, K) -> (T, G, R): group g's K inputs times weight rows [g * R, (g + 1) * R) (a block-diagonal
        product, V4's wo_a), one grouped FP8 GEMM over the weight as loaded (fp8_gemm's `groups`)."""
        from deepinfer_kernels.fp8_gemm import fp8_gemm, fp8_invariant_gemm

        t, groups = x.shape[0], x.shape[1]
        x2 = x.reshape(t, -1)
        if self.is_batch_invariant:
            y = fp8_invariant_gemm(x2, layer.weight, layer.weight_scale_inv, layer.scale_group_n, self.block[1],
                                   groups=groups)
        else:
            y = fp8_gemm(x2, layer.weight, layer.weight_scale_inv, layer.scale_group_n, self.block[1], None,
                         self.gemm_path, self.split_sum, self.pdl, groups=groups, split_rows=self.split_rows)
        return y.view(t, groups, -1)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.is_checkpoint_quantized:
            scale = layer.weight_scale_inv.data
        else:
            q, scale = self.quantize(layer)
            layer.weight = nn.Parameter(q, requires_grad=False)
        bn = self.block[0]
        starts = [start for start, _ in layer.shard_rows.values()]
        layer.scale_group_n = bn
        if any(start % bn for start in starts):
            scale = torch.cat([scale[scale_rows].repeat_interleave(bn, dim=0)[: rows.stop - rows.start]
                               for rows, scale_rows in self.shards(layer)])
            layer.scale_group_n = 1
        layer.weight_scale_inv = nn.Parameter(scale.contiguous(), requires_grad=False)


def weight_linear_method(config: KernelConfig) -> LinearMethod:
    """The method of a layer holding a model weight (Linear, MergedLinear): FP8 under `quantization == 'fp8'`
    (the GEMM on CUDA, dequantized elsewhere), weight-only int8 under 'int8' (CPU, layers/int8.py), 4-bit under 'q4_1' (CPU, layers/q4.py), else the
    config's unquantized method. One method object per (config, DEEPINFER_FP8_GEMM, DEEPINFER_FP8_SPLIT_SUM,
    DEEPINFER_FP8_SPLIT_ROWS)."""
    env = get_env()
    return _weight_linear_method(config, env.fp8_gemm, env.fp8_split_sum, env.fp8_split_rows)


@functools.cache
def _weight_linear_method(config: KernelConfig, gemm_path: str, split_sum: str = "kernel",
                          split_rows: int | None = None) -> LinearMethod:
    if config.quantization == "int8":
        from deepinfer_rt.layers.int8 import Int8WeightOnlyLinear

        return Int8WeightOnlyLinear()
    if config.quantization == "q4_1":
        from deepinfer_rt.layers.q4 import Q4WeightOnlyLinear

        return Q4WeightOnlyLinear()
    if config.quantization != "fp8":
        return linear_method(config)
    if config.is_triton:
        return Fp8BlockLinear(config.weight_block_size, config.is_checkpoint_quantized, config.scale_fmt, gemm_path,
                              config.is_batch_invariant, split_sum, config.uses_pdl, split_rows)
    return dense_linear_method(config)


@functools.cache
def dense_linear_method(config: KernelConfig) -> LinearMethod:
    """For a weight that other code reads as a dense matrix (MLA's kv_b): FP8 checkpoints dequantize at load."""
    if config.quantization != "fp8":
        return linear_method(config)
    return Fp8DequantLinear(config.weight_block_size, config.is_checkpoint_quantized, linear_method(config),
                            config.scale_fmt)


# ---- routed experts ----

class ExpertWeights:
    """How RoutedExperts hold their fused weights: as loaded (16/32-bit)."""

    is_quantized = False
    """Whether the weights stay quantized on the device (Fp8BlockExperts)."""

    def create_weights(self, experts: nn.Module) -> None:
        pass

    def process_weights_after_loading(self, experts: nn.Module) -> None:
        pass


class Fp8DequantExperts(ExpertWeights):
    """FP8 routed experts, dequantized at load to the engine dtype (on CUDA too, for now: the fused MoE kernel
    reads 16-bit weights). Checkpoint scales: `experts.gate_up_proj_scale_inv` (E, 2 ceil(I/bn), ceil(H/bk)),
    gate's blocks then up's, and `experts.down_proj_scale_inv` (E, ceil(H/bn), ceil(I/bk))."""

    def __init__(self, block: tuple[int, int], is_checkpoint_quantized: bool, scale_fmt: str = "float32"):
        self.block = block
        self.is_checkpoint_quantized = is_checkpoint_quantized
        self.scale_fmt = scale_fmt

    def create_weights(self, experts: nn.Module) -> None:
        if not self.is_checkpoint_quantized:
            return
        bn, bk = self.block
        e, two_i, hidden = experts.gate_up_proj.shape
        experts.gate_up_proj_scale_inv = _scale_param(2 * _cdiv(two_i // 2, bn), _cdiv(hidden, bk), (e,))
        experts.down_proj_scale_inv = _scale_param(_cdiv(hidden, bn), _cdiv(two_i // 2, bk), (e,))
        for name in ("gate_up_proj", "down_proj"):
            getattr(experts, name).is_fp8_checkpoint = True
            getattr(experts, name).weight_loader = load_fp8_weight
            getattr(experts, name + SCALE_SUFFIX).weight_loader = self.load_scale

    def load_scale(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        loaded = read_scale(loaded, self.scale_fmt)
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"scale shape {tuple(loaded.shape)} != {tuple(param.shape)}, the "
                             f"{self.block[0]}x{self.block[1]} blocks of each expert's projection")
        param.data.copy_(loaded)

    @torch.no_grad()
    def process_weights_after_loading(self, experts: nn.Module) -> None:
        for name, shards in (("gate_up_proj", 2), ("down_proj", 1)):
            w = getattr(experts, name).data
            rows = w.shape[1] // shards
            scale = getattr(experts, name + SCALE_SUFFIX).data if self.is_checkpoint_quantized else None
            if scale is not None and scale.shape[0] != w.shape[0]:
                raise ValueError(f"{name}: scales for {scale.shape[0]} experts, weights for {w.shape[0]} "
                                 "(a shard cut its weights and scales apart)")
            dense = torch.empty_like(w)
            for s in range(shards):
                part = w[:, s * rows : (s + 1) * rows]
                if scale is None:
                    q, part_scale = quantize_fp8_blocks(part, self.block)
                else:
                    blocks = _cdiv(rows, self.block[0])
                    q, part_scale = part, scale[:, s * blocks : (s + 1) * blocks]
                dense[:, s * rows : (s + 1) * rows] = dequantize_fp8_blocks(q, part_scale, self.block, w.dtype)
            getattr(experts, name).data = dense
            if scale is not None:
                setattr(experts, name + SCALE_SUFFIX, None)


class Fp8BlockExperts(Fp8DequantExperts):
    """CUDA: float8 routed experts and their float32 block scales stay on the device for the
    FP8 fused MoE (deepinfer_kernels.fused_moe_fp8, layers/moe.py Fp8FusedExperts); a 16/32-bit checkpoint is
    quantized at load per projection (gate's and up's blocks apart), as scripts/quantize_checkpoint.py would."""

    is_quantized = True

    def create_weights(self, experts: nn.Module) -> None:
        super().create_weights(experts)
        if not self.is_checkpoint_quantized:
            return
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(experts, name)
            new = nn.Parameter(torch.empty_like(old, dtype=torch.float8_e4m3fn), requires_grad=False)
            new.is_fp8_checkpoint, new.weight_loader = True, old.weight_loader
            setattr(experts, name, new)

    @torch.no_grad()
    def process_weights_after_loading(self, experts: nn.Module) -> None:
        if getattr(experts, "fp8_tiled", False):
            return  # already final and tiled (a module finalized twice must not be reordered twice)
        self._quantize(experts)
        gate_up = experts.gate_up_proj.data
        if get_env().fp8_moe_tiles and gate_up.shape[0] and hasattr(experts.method, "tiled"):  # the fused kernel runs
            from deepinfer_kernels.fused_moe_fp8 import tile_experts, tiles_supported

            if tiles_supported(gate_up, self.block[1]):
                for name in ("gate_up_proj", "down_proj"):
                    w = getattr(experts, name).data
                    tile_experts(w, self.block[1], out=w)
                experts.fp8_tiled = experts.method.tiled = True

    def _quantize(self, experts: nn.Module) -> None:
        for name, shards in (("gate_up_proj", 2), ("down_proj", 1)):
            w = getattr(experts, name).data
            if self.is_checkpoint_quantized:
                scale = getattr(experts, name + SCALE_SUFFIX).data
                if scale.shape[0] != w.shape[0]:
                    raise ValueError(f"{name}: scales for {scale.shape[0]} experts, weights for {w.shape[0]} "
                                     "(a shard cut its weights and scales apart)")
                continue
            # Expert by expert: a whole tensor's fp32 temporaries are several times its size (V3's gate_up: 28 GiB).
            # Shards (gate | up) have scale blocks of their own.
            q = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
            scales = []
            for e in range(max(w.shape[0], 1)):  # an EP rank with no experts: the empty tensor once, for its shape
                part = w[e] if w.shape[0] else w
                parts = [quantize_fp8_blocks(p, self.block) for p in part.chunk(shards, dim=-2)]
                if w.shape[0]:
                    q[e] = torch.cat([p for p, _ in parts])
                scales.append(torch.cat([s for _, s in parts], dim=-2))
            scale = torch.stack(scales) if w.shape[0] else scales[0]
            setattr(experts, name, nn.Parameter(q, requires_grad=False))
            setattr(experts, name + SCALE_SUFFIX, nn.Parameter(scale, requires_grad=False))


def is_fp8_fused_experts(config: KernelConfig) -> bool:
    """Whether layers/moe.py's routed experts run the FP8 fused MoE (FP8 weights kept): CUDA with Triton, FP8 (not
    MXFP4) experts; in batch-invariant mode with its one fixed configuration."""
    return config.quantization == "fp8" and config.is_triton and config.expert_dtype == "fp8"
