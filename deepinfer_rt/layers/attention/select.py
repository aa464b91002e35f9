"""The attention backend for a device and mode: one rule for the engine and the expert-parallel workers."""
from __future__ import annotations

import torch

from deepinfer_rt.layers.attention.base import AttentionBackend


def select_backend(device: torch.device, batch_invariant: bool, is_kv_fp8: bool = False) -> AttentionBackend:
    """Batch-invariant mode: fixed-split attention (the Triton kernel on CUDA); CUDA: the Triton kernels; else
    the torch reference. `is_kv_fp8`: the pool stores fp8_e4m3 rows with scales (every backend reads them; the
    Triton one then stores through its quantizing kernel and MLA's fused norm-rope-store is off)."""
    if batch_invariant and device.type == "cuda":
        from deepinfer_rt.layers.attention.triton_invariant import TritonInvariantBackend

        return TritonInvariantBackend()
    if batch_invariant:
        from deepinfer_rt.layers.attention.batch_invariant import BatchInvariantBackend

        return BatchInvariantBackend()
    if device.type == "cuda":
        from deepinfer_rt.layers.attention.triton import TritonBackend

        return TritonBackend(device, is_kv_fp8)
    from deepinfer_rt.layers.attention.torch_ref import BACKENDS

    return BACKENDS["torch"]()
