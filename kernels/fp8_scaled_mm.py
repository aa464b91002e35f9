"""Path A of the block-scaled FP8 GEMM (deepinfer_kernels.fp8_gemm): torch.nn.functional.scaled_mm with the
DeepSeek recipes (cuBLASLt, SM90, torch >= 2.10), over activations quantized by deepinfer_kernels.fp8_quant, and
the checks of whether this build, device and GEMM can take it."""
from __future__ import annotations

import torch
import triton


def _round_up(a: int, b: int) -> int:
    return triton.cdiv(a, b) * b


SCALED_MM_ROW_MULTIPLE = 4
"""cuBLASLt's block-scaled GEMM reads the M-major activation scales in rows of a multiple of 4 tokens: x is
quantized into that many rows (zeros past M) and the output sliced back."""


def scaled_mm_api_missing() -> str | None:
    """Why this torch build cannot run path A (None when it has the API): torch.nn.functional.scaled_mm with the
    BlockWise1x128 / BlockWise128x128 recipes (torch >= 2.10's scaled_mm v2)."""
    functional = torch.nn.functional
    recipes = getattr(getattr(functional, "ScalingType", None), "__members__", {})
    if not hasattr(functional, "scaled_mm") or not {"BlockWise1x128", "BlockWise128x128"} <= set(recipes):
        return (f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with the BlockWise1x128 / "
                "BlockWise128x128 scaling recipes")
    return None


_SCALED_MM_PROBED: dict[int, str | None] = {}


def scaled_mm_unsupported(device: torch.device) -> str | None:
    """Why path A cannot run on `device` (None when it can): the torch API, a CUDA SM90 device (cuBLASLt's
    DeepSeek-style scaling is Hopper-only) and cuBLASLt >= 12.9, probed once per device by a 128^3 product."""
    missing = scaled_mm_api_missing()
    if missing is not None:
        return missing
    if device.type != "cuda":
        return f"block-scaled scaled_mm needs a CUDA device, not {device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SCALED_MM_PROBED:
        major, minor = torch.cuda.get_device_capability(index)
        if major != 9:
            _SCALED_MM_PROBED[index] = f"block-scaled scaled_mm is SM90-only (device is SM{major}{minor})"
        else:
            xq = torch.zeros(128, 128, dtype=torch.float8_e4m3fn, device=device)
            x_scale = torch.ones(1, 128, dtype=torch.float32, device=device).t()  # M-major, as fp8_quant's
            try:
                fp8_scaled_mm(xq, x_scale, 128, xq, torch.ones(1, 1, device=device), torch.bfloat16)
                _SCALED_MM_PROBED[index] = None
            except (RuntimeError, NotImplementedError) as e:
                _SCALED_MM_PROBED[index] = f"block-scaled scaled_mm failed on this build: {str(e).splitlines()[0]}"
    return _SCALED_MM_PROBED[index]


def scaled_mm_shape_unsupported(n: int, k: int, group_n: int, block_k: int, out_dtype: torch.dtype) -> str | None:
    """Why path A does not take this GEMM (None when it does): 128 x 128 weight blocks, N and K multiples of 128
    (the recipes' scale shapes are N / 128 and K / 128), a bf16 output."""
    if (group_n, block_k) != (128, 128):
        return f"weight scales per {group_n} x {block_k}, not 128 x 128 blocks"
    if n % 128 or k % 128:
        return f"N = {n} and K = {k} must be multiples of 128"
    if out_dtype != torch.bfloat16:
        return f"output {out_dtype}, not bfloat16"
    return None


def fp8_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, m: int, weight: torch.Tensor,
                  weight_scale_inv: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Path A: torch.nn.functional.scaled_mm with the DeepSeek recipes (cuBLASLt on SM90). xq (M_pad, K) and
    x_scale (M_pad, K/128) M-major from deepinfer_kernels.fp8_quant (M_pad a multiple of 4), weight (N, K) with
    (N/128, K/128) scales -> (m, N). The weight scales go in as (L4, N/128) with strides (1, L4), L4 = K/128
    rounded up to 4 (zero-padded when it is not)."""
    functional = torch.nn.functional
    n, k_blocks = weight_scale_inv.shape
    l4 = _round_up(k_blocks, 4)
    if l4 != k_blocks:
        padded = weight_scale_inv.new_zeros(n, l4)
        padded[:, :k_blocks] = weight_scale_inv
        weight_scale_inv = padded
    y = functional.scaled_mm(xq, weight.t(), x_scale, functional.ScalingType.BlockWise1x128,
                             weight_scale_inv.t(), functional.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    y = y[:m]
    return y if bias is None else y + bias
