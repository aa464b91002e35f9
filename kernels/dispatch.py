"""Whether a tensor's op runs through the Triton kernels (CUDA tensors, Triton importable) or `reference`."""
from __future__ import annotations

import importlib.util

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda and HAS_TRITON


def pdl_supported(device: torch.device) -> bool:
    """Whether `device` takes programmatic dependent launches (a CUDA GPU of compute capability 9.0 or above)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(pdl: bool) -> dict:
    """The launch arguments of a Triton kernel with a PDL constexpr: as a programmatic dependent launch (SM90+: it
    may start while the kernel before it in the stream finishes, and waits for it in-kernel, tl.extra.cuda.gdc_wait,
    before touching anything that kernel or one before it wrote; a CUDA graph captures the dependency as such), or
    as an ordinary launch. Kernels that take no weight before the wait open with it (`pdl_wait`).

    A kernel launched so must wait before it reads or writes anything another kernel of the stream touches (its
    reads can race the kernel before it, its writes that kernel's reads); only read-only inputs (weights) may be
    loaded before the wait."""
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)



if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """The opening of a kernel with a PDL constexpr that loads nothing before the wait: wait for the kernels
        before it, then let the next one launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
