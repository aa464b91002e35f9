"""Batch-invariant numerics on CPU: the torch forms of the ops that batch-invariant mode changes.

In batch-invariant mode every value a token's output depends on is computed by the same sequence of
floating-point operations whatever else shares its batch. On CPU the default ops break this in two ways:

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
The functions here are always the invariant forms; which form a layer runs (these, the Triton kernels of
deepinfer_kernels.batch_invariant on CUDA, or the default ops) is its method, chosen when the layer is built
(deepinfer_rt.layers.methods).
"""
from __future__ import annotations

import torch

from deepinfer_kernels import reference
from deepinfer_rt.layers import invariant_gemm


def tiled_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ w_t (K, N), each row computed the same way for any T."""
    return invariant_gemm.tiled_mm(x, w_t)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, batch-invariant. x (..., K), weight (N, K)."""
    y = tiled_mm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], weight.shape[0])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-head matmul x (T, H, A) @ w (H, A, B) -> (T, H, B) (MLA's absorbed projections), batch-invariant."""
    return torch.stack([tiled_mm(x[:, h], w[h]) for h in range(w.shape[0])], dim=1)


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) for x (T, H), gate_up (2I, H) = [gate; up], down (H, I), batch-invariant.
    The activations stay as columns, (2I, T) then (I, T), from the gate/up GEMM into the down GEMM's calls
    (invariant_gemm's columns form): the two row-major copies between them would cost a third of a prefill
    chunk's GEMM time."""
    if x.dim() != 2:
        return linear(silu_and_mul(linear(x, gate_up)), down)
    t = x.shape[0]
    if t == 0:
        return x.new_empty(0, down.shape[0])
    h_t = invariant_gemm.tiled_mm_to_cols(x, gate_up.t())  # (2I, P), P >= T (zero inputs past T)
    a_t = _silu_mul(*h_t.chunk(2, dim=0))  # (I, P): silu_and_mul's ops, element for element
    y_t = invariant_gemm.tiled_mm_cols(a_t, down.t(), t)
    return y_t[:, :t].t().contiguous()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2d) = [gate | up] -> silu(gate) * up (..., d)."""
    return _silu_mul(*x.chunk(2, dim=-1))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate / (1 + exp(-gate)) * up from exp and IEEE arithmetic (see the module docstring), fewer temporaries."""
    return (gate / gate.neg().exp_().add_(1.0)).mul_(up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and x.shape[0] == 1:
        # A single output lets torch split one row's reduction across threads; two rows never do.
        return reference.rms_norm(torch.cat([x, x]), weight, eps)[:1]
    return reference.rms_norm(x, weight, eps)
