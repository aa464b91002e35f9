"""Batch-invariant numerics: the switch the layers consult, and the CPU (torch) forms of the ops it changes.

With the switch on, every value a token's output depends on is computed by the same sequence of floating-point
operations whatever else shares its batch. On CPU the default ops break this in two ways:

  * GEMM: the BLAS picks its kernel, blocking and thread split from the shape, so a row of x @ w.T differs
    with the number of rows (M = 1 takes a GEMV path, small M another kernel, some M split K across threads).
    Here every matmul is cut into calls of a few fixed shapes whose rows are checked to agree
    (deepinfer_rt.layers.invariant_gemm).
  * Elementwise ops: torch runs the bulk of a tensor through SIMD code and the last few elements of each
    thread's range through scalar code; for sigmoid/silu the two differ in the last bit, so a value depends
    on where its row landed. exp, log, sqrt and the IEEE arithmetic ops agree in both paths, so sigmoid and
    silu are rebuilt from them.

Row-wise reductions over the last dim (RMSNorm's mean, softmax, log-softmax, argmax) are already computed per
row the same way for any number of rows (test/unit/test_batch_invariant_ops.py checks every op here).
On CUDA the same entry points dispatch to the Triton kernels in deepinfer_kernels.batch_invariant.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F

from deepinfer_kernels import reference
from deepinfer_rt.env import get_env
from deepinfer_rt.layers import invariant_gemm

_enabled = False


def is_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Scope in which the layers use the batch-invariant forms (the engine wraps each model step in it)."""
    global _enabled
    previous, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = previous


@functools.cache
def _skinny_gemm_on() -> bool:
    return get_env().skinny_gemm


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda


def tiled_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ w_t (K, N), each row computed the same way for any T."""
    if _use_triton(x):
        from deepinfer_kernels.batch_invariant import matmul

        return matmul(x, w_t)
    return invariant_gemm.tiled_mm(x, w_t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, batch-invariant when the switch is on. x (..., K), weight (N, K). Off, a CUDA x of at most 16
    rows times a large weight takes the skinny GEMM kernel (DEEPINFER_SKINNY_GEMM)."""
    if not _enabled:
        if x.is_cuda and _skinny_gemm_on():
            from deepinfer_kernels import skinny_gemm

            if skinny_gemm.supports(x, weight):
                return skinny_gemm.skinny_gemm(x, weight, bias)
        return F.linear(x, weight, bias)
    y = tiled_mm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul x (T, H, A) @ w (H, A, B) -> (T, H, B) (MLA's absorbed projections)."""
    if not _enabled:
        if not x.is_cuda or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
            return torch.einsum("tha,hab->thb", x, w)  # (bmm's out= form does not take autograd inputs)
        # cuBLAS writes the (T, H, B) result through its strides (batch stride B, row stride H * B), where
        # einsum's (H, T, B) result would need a transposing copy before the projection that reads it.
        out = x.new_empty(x.shape[0], w.shape[0], w.shape[2])
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out
    if _use_triton(x):
        from deepinfer_kernels.batch_invariant import head_matmul as triton_head_matmul

        return triton_head_matmul(x, w)
    return torch.stack([tiled_mm(x[:, h], w[h]) for h in range(w.shape[0])], dim=1)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for x (T, H), gate_up (2I, H) = [gate; up], down (H, I), batch-invariant.
    On CPU the activations stay as columns, (2I, T) then (I, T), from the gate/up GEMM into the down GEMM's
    calls (invariant_gemm's columns form): the two row-major copies between them would cost a third of a
    prefill chunk's GEMM time."""
    if _use_triton(x) or x.dim() != 2:
        return linear(silu_and_mul(linear(x, gate_up)), down)
    t = x.shape[0]
    if t == 0:
        return x.new_empty(0, down.shape[0])
    h_t = invariant_gemm.tiled_mm_to_cols(x, gate_up.t())  # (2I, P), P >= T (zero inputs past T)
    a_t = _silu_mul(*h_t.chunk(2, dim=0))  # (I, P): silu_and_mul's ops, element for element
    y_t = invariant_gemm.tiled_mm_cols(a_t, down.t(), t)
    return y_t[:, :t].t().contiguous()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    if not _enabled:
        return x.sigmoid()
    return 1.0 / (1.0 + torch.exp(-x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2d) = [gate | up] -> silu(gate) * up (..., d)."""
    if not _enabled:
        return reference.silu_and_mul(x)
    if _use_triton(x):
        from deepinfer_kernels.batch_invariant import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    return _silu_mul(*x.chunk(2, dim=-1))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate / (1 + exp(-gate)) * up from exp and IEEE arithmetic (see the module docstring), fewer temporaries."""
    return (gate / gate.neg().exp_().add_(1.0)).mul_(up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _enabled:
        return reference.rms_norm(x, weight, eps)
    if _use_triton(x):
        from deepinfer_kernels.batch_invariant import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    if x.dim() == 2 and x.shape[0] == 1:
        # A single output lets torch split one row's reduction across threads; two rows never do.
        return reference.rms_norm(torch.cat([x, x]), weight, eps)[:1]
    return reference.rms_norm(x, weight, eps)
