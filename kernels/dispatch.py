"""Whether a tensor's op runs through the Triton kernels (CUDA tensors, Triton importable) or `reference`."""
from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda and HAS_TRITON


def pdl_supported(device: torch.device) -> bool:
    """Whether `device` takes programmatic dependent launches (a CUDA GPU of compute capability 9.0 or above)."""
    return torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(pdl: bool) -> dict:
    """The launch arguments of a Triton kernel with a PDL constexpr: as a programmatic dependent launch (SM90+: it
    may start while the kernel before it in the stream finishes, and waits for it in-kernel, tl.extra.cuda.gdc_wait,
    before touching anything that kernel or one before it wrote; a CUDA graph captures the dependency as such), or
    as an ordinary launch."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)
