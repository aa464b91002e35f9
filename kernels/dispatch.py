"""Whether a tensor's op runs through the Triton kernels (CUDA tensors, Triton importable) or `reference`."""
from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda and HAS_TRITON
