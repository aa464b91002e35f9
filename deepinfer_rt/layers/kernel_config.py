"""KernelConfig: the modes a model's layers are built for, fixed once per model.

Layers choose their method objects (deepinfer_rt.layers.methods, the MoE and MLA methods, a model's own) from
it in `__init__` and keep them; a layer's forward only calls them. It is built once from the environment
(deepinfer_rt.env) and the engine arguments (`KernelConfig.from_env`); nothing below reads the environment
again.

Models are built inside `build_context(kernel_config)` (models.loader.build_model, the EP workers); layers read
it with `current_kernel_config()`. Outside a build context that gives the default: CPU, not batch-invariant,
the other knobs from the environment.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

import torch

from deepinfer_kernels.dispatch import HAS_TRITON
from deepinfer_rt.config import QuantConfig
from deepinfer_rt.env import get_env

QUANTIZATIONS = (None, "fp8", "int8", "q4_1")
"""What `Engine(quantization=)` takes."""


@dataclass(frozen=True)
class KernelConfig:
    device_type: str = "cpu"
    """torch device type the model runs on ("cpu", "cuda"): picks Triton kernels or the torch forms."""
    is_batch_invariant: bool = False
    """Batch-invariant numerics: every value a token's output depends on is computed by the same operations
    whatever else shares its batch (layers/batch_invariant.py, deepinfer_kernels.batch_invariant)."""
    is_skinny_gemm: bool = True
    """DEEPINFER_SKINNY_GEMM: dense projections of at most 16 rows on CUDA through deepinfer_kernels.skinny_gemm
    instead of cuBLAS (never in batch-invariant mode)."""
    mla_mha_prefill: bool | None = None
    """DEEPINFER_MLA_MHA_PREFILL: MLA prefill chunks in the standard form. None = where the attention backend
    prefers it (Triton), for chunks of at least layers.mla_prefill.MHA_MIN_QUERIES new tokens; True = every chunk
    of more than one new token, on any backend; False = never. Never in batch-invariant mode."""
    mla_prefix_split: bool | None = None
    """DEEPINFER_MLA_PREFIX_SPLIT: a standard-form MLA chunk over a cached prefix attends to the prefix and to its
    own keys as two unmasked / causal kernels merged by log-sum-exp (layers.mla_prefill.prefix_split_attention).
    None = on CUDA for 16-bit activations on Hopper or newer (cuDNN), chunks aligned to PREFIX_SPLIT_ALIGN only;
    True = every chunk over a prefix, on any device; False = never."""
    is_cpu_fast_step: bool = True
    """DEEPINFER_CPU_FAST_STEP: Llama-family trunks on CPU run the flat step (models/llama_step.py) rather than
    the modules (never in batch-invariant mode)."""
    is_gpu_row_step: bool = True
    """DEEPINFER_GPU_ROW_STEP: Llama-family trunks on CUDA run steps of at most 4 tokens through the fused row step
    (models/llama_gpu_step.py) rather than the modules (never in batch-invariant mode or with quantized weights)."""
    is_gpu_pdl: bool = False
    """DEEPINFER_GPU_PDL: the kernels that take it launch as programmatic dependent launches on SM90+ (env.py,
    `uses_pdl`)."""
    is_cpu_compile: bool = False
    """DEEPINFER_CPU_COMPILE: the CPU step (dense weights) compiled between its attention calls
    (models/llama_compiled.py)."""
    moe_router_skew: float = 0.0
    """DEEPINFER_MOE_ROUTER_SKEW: benchmarks only; biases MoE routers toward low expert ids (Zipf exponent)."""
    quantization: str | None = None
    """'fp8': the linear and expert weights are block-scaled float8 e4m3 (layers/fp8.py; MXFP4 experts with
    expert_dtype 'fp4', layers/mxfp4.py): loaded so from the checkpoint or quantized at load. On CUDA (not
    batch-invariant) the linears run the W8A8 block GEMM and FP8 routed experts the FP8 fused MoE; elsewhere, and
    for MXFP4 experts, DeepSeek-V4's experts and MLA's kv_b, they are dequantized at load to the engine dtype.
    'int8' (CPU, not batch-invariant): the linears' weights per-row int8 at load, activations in the engine dtype
    (layers/int8.py). 'q4_1' (CPU, not batch-invariant): the linears' weights in GGUF's Q4_1 layout (4-bit codes,
    fp16 scale and min per 32 weights; layers/q4.py). None: the engine dtype throughout."""
    is_checkpoint_quantized: bool = False
    """Whether the checkpoint stores the weights quantized (FP8 values + `weight_scale_inv`), rather than in
    16/32-bit for `quantization` to quantize at load."""
    weight_block_size: tuple[int, int] = (128, 128)
    """(rows, columns) of weight per FP8 scale."""
    scale_fmt: str = "float32"
    """The checkpoint's scale encoding (QuantConfig.scale_fmt): 'float32' or 'ue8m0' (decoded to float32 at
    load: a power of two is exact there)."""
    expert_dtype: str = "fp8"
    """The checkpoint's routed experts (QuantConfig.expert_dtype): 'fp8' or 'fp4' (MXFP4, layers/mxfp4.py)."""

    @property
    def is_triton(self) -> bool:
        """Whether the layers run the Triton kernels (CUDA with Triton importable) rather than the torch forms."""
        return self.device_type == "cuda" and HAS_TRITON

    @property
    def uses_pdl(self) -> bool:
        """Whether the kernels that take it launch as programmatic dependent launches: DEEPINFER_GPU_PDL with the
        Triton kernels on an SM90+ GPU (deepinfer_kernels.dispatch.pdl_supported)."""
        from deepinfer_kernels.dispatch import pdl_supported

        return self.is_gpu_pdl and self.is_triton and pdl_supported(torch.device("cuda"))

    @classmethod
    def from_env(cls, device: torch.device | str = "cpu", batch_invariant: bool = False,
                 quantization: str | None = None) -> "KernelConfig":
        """The config for a model on `device`: batch_invariant and quantization from the engine arguments (the
        former already folds in DEEPINFER_BATCH_INVARIANT), the layer knobs from the environment."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
        if quantization in ("int8", "q4_1") and (torch.device(device).type != "cpu" or batch_invariant):
            raise ValueError(f"quantization={quantization!r} (weight-only, torch's CPU int8 / int4 matmul) runs on "
                             f"CPU and not in batch-invariant mode")
        env = get_env()
        return cls(device_type=torch.device(device).type, is_batch_invariant=batch_invariant,
                   is_skinny_gemm=env.skinny_gemm, mla_mha_prefill=env.mla_mha_prefill,
                   mla_prefix_split=env.mla_prefix_split,
                   moe_router_skew=env.moe_router_skew, quantization=quantization,
                   is_cpu_fast_step=env.cpu_fast_step, is_cpu_compile=env.cpu_compile,
                   is_gpu_row_step=env.gpu_row_step, is_gpu_pdl=env.gpu_pdl)

    def for_checkpoint(self, quant: QuantConfig | None) -> "KernelConfig":
        """This config for a model whose checkpoint stores its weights as `quant` (ModelConfig.quantization): an
        FP8 checkpoint makes the layers FP8 whatever was asked (on CPU they dequantize it at load)."""
        if quant is None:
            return self
        return dataclasses.replace(self, quantization=quant.method, is_checkpoint_quantized=True,
                                   weight_block_size=quant.weight_block_size, scale_fmt=quant.scale_fmt,
                                   expert_dtype=quant.expert_dtype)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX-BF16 or AVX512-BF16), where bf16 GEMMs beat fp32 ones."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    if any(p is not None for p in probes):
        return any(p is not None and p() for p in probes)
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


_current: KernelConfig | None = None


def current_kernel_config() -> KernelConfig:
    """The config of the model being built (build_context), else the default (CPU, not invariant, from env)."""
    return _current if _current is not None else KernelConfig.from_env()


@contextlib.contextmanager
def build_context(config: KernelConfig) -> Iterator[KernelConfig]:
    """Scope in which constructed layers take their methods from `config` (model construction only)."""
    global _current
    previous, _current = _current, config
    try:
        yield config
    finally:
        _current = previous
