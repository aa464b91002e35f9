"""The attention backend for a device and mode: one rule for the engine and the expert-parallel workers."""
from __future__ import annotations

import torch

from deepinfer_rt.layers.attention.base import AttentionBackend


def select_backend(device: torch.device, batch_invariant: bool) -> AttentionBackend:
    """Batch-invariant mode: fixed-split attention (the Triton kernel on CUDA); CUDA: the Triton kernels; else
    the torch reference."""
    if batch_invariant and device.type == "cuda":
        from deepinfer_rt.layers.attention.triton_invariant import TritonInvariantBackend

        return TritonInvariantBackend()
    if batch_invariant:
        from deepinfer_rt.layers.attention.batch_invariant import BatchInvariantBackend

        return BatchInvariantBackend()
    if device.type == "cuda":
        from deepinfer_rt.layers.attention.triton import TritonBackend

        return TritonBackend(device)
    from deepinfer_rt.layers.attention.torch_ref import BACKENDS

    return BACKENDS["torch"]()
