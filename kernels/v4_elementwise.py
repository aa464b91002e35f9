"""DeepSeek-V4's per-token glue in Triton: the RMSNorms (weighted and unweighted) and the rotary embedding of the
trailing channels, each one launch where the torch forms take 6-12 (casts, powers, means, the interleaved
rotation's slices, stacks and concatenations). At batch 1 a V4 layer ran ~265 kernels, 955 of 1,060 under 3 µs
(benchmark/README.md); these are the most frequent.

The arithmetic is the torch forms' (models/deepseek_v4/methods.py), in fp32 with one cast at the end;
only the order of the fp32 sums of squares (a tree here) and the rounding of the rotation's multiply-adds differ,
so results agree to rounding, not bitwise; the batch-invariant methods keep the torch forms.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

MAX_BLOCK = 4096
"""Columns a norm program holds at once; longer rows (the hyper-connections' flattened streams) loop."""


@triton.jit
def _rms_norm_kernel(X, W, Out, stride_x, stride_o, n_cols, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                     ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row, o_row = X + row * stride_x, Out + row * stride_o
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
        if HAS_W:  # weight (fp32) x (x . inv) in fp32, one cast
            y = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32) * (xf * inv)
        else:  # x x inv rounded to the output's dtype, the product in fp32 then rounded (torch's bf16 x bf16)
            y = x.to(tl.float32) * inv.to(Out.dtype.element_ty).to(tl.float32)
        tl.store(o_row + offs, y.to(Out.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            mask = c0 + offs < n_cols
            xf = tl.load(x_row + c0 + offs, mask=mask, other=0.0).to(tl.float32)
            acc += xf * xf
        inv = tl.math.rsqrt(tl.sum(acc, 0) / n_cols + eps)
        for c0 in range(0, n_cols, BLOCK):
            mask = c0 + offs < n_cols
            x = tl.load(x_row + c0 + offs, mask=mask, other=0.0)
            if HAS_W:
                y = tl.load(W + c0 + offs, mask=mask, other=0.0).to(tl.float32) * (x.to(tl.float32) * inv)
            else:
                y = x.to(tl.float32) * inv.to(Out.dtype.element_ty).to(tl.float32)
            tl.store(o_row + c0 + offs, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out_dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    """Over x's last dim. weight given (V4RMSNorm): (weight.float() * (xf * rsqrt(mean(xf^2) + eps))).to(x.dtype);
    None (methods._unweighted_rms_norm): x * rsqrt(mean(xf^2) + eps).to(x.dtype). Returns a new tensor of x's
    shape, in x's dtype or `out_dtype` (float32 from a 16-bit x: the norm of x.float(), without that copy)."""
    d = x.shape[-1]
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"v4 rms_norm: weight {tuple(weight.shape)} for rows of {d}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"v4 rms_norm: {x.dtype} rows normalised into {out_dtype}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(d))
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, out, x2.stride(0), out.stride(0),
                                         d, eps, HAS_W=weight is not None, BLOCK=block, ONE_PASS=block >= d,
                                         num_warps=4 if block <= 1024 else 8, **pdl_launch(pdl))
    return out.view(x.shape)


@triton.jit
def _rope_kernel(X, Cos, Sin, Out, stride_xn, stride_xm, stride_on, stride_om, stride_c, num_m, nope,
                 HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NOPE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < num_m
    x_rows = X + n * stride_xn + offs_m.to(tl.int64)[:, None] * stride_xm
    o_rows = Out + n * stride_on + offs_m.to(tl.int64)[:, None] * stride_om
    if BLOCK_NOPE > 0:  # the leading channels, unchanged
        offs_d = tl.arange(0, BLOCK_NOPE)
        dmask = mmask[:, None] & (offs_d[None, :] < nope)
        tl.store(o_rows + offs_d[None, :], tl.load(x_rows + offs_d[None, :], mask=dmask), mask=dmask)
    offs_j = tl.arange(0, HALF)
    c = tl.load(Cos + n * stride_c + offs_j)[None, :]
    s = tl.load(Sin + n * stride_c + offs_j)[None, :]
    even = nope + 2 * offs_j[None, :]
    x1 = tl.load(x_rows + even, mask=mmask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + even + 1, mask=mmask[:, None], other=0.0).to(tl.float32)
    y1 = x1 * c - x2 * s  # methods.apply_rope's terms, in fp32 (a fused multiply-add may round once less)
    y2 = x2 * c + x1 * s
    tl.store(o_rows + even, y1.to(Out.dtype.element_ty), mask=mmask[:, None])
    tl.store(o_rows + even + 1, y2.to(Out.dtype.element_ty), mask=mmask[:, None])


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pdl: bool = False,
         inplace: bool = False) -> torch.Tensor:
    """methods.apply_rope in one launch: x (N, ..., D) rotated on its trailing 2 * R/2 channels by adjacent pairs
    (2j, 2j + 1), cos / sin (N, R/2) fp32 (-sin undoes a rotation). Returns a new tensor and leaves x as it was,
    or with `inplace` rotates x's rope channels where it lies (x's other channels are neither read nor written:
    a 64-of-512 rotation moves an eighth of the bytes) and returns it; where x's rows are not contiguous in D the
    rotation happens in a contiguous copy, which is returned, so callers use the result, never x."""
    n, d = x.shape[0], x.shape[-1]
    half = cos.shape[-1]
    if half & (half - 1) or sin.shape != cos.shape or cos.shape[0] != n or 2 * half > d:
        raise ValueError(f"v4 rope: cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} for x {tuple(x.shape)}")
    x3 = x.reshape(n, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = x3 if inplace else torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    m, nope = x3.shape[1], d - 2 * half
    block_m = min(16, triton.next_power_of_2(max(1, m)))
    if n and m:  # each program reads a pair before it writes it, so out may be x
        _rope_kernel[(n, triton.cdiv(m, block_m))](
            x3, cos, sin, out, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), cos.stride(0), m, nope,
            HALF=half, BLOCK_M=block_m, BLOCK_NOPE=triton.next_power_of_2(nope) if nope and not inplace else 0,
            num_warps=4, **pdl_launch(pdl))
    return out.view(x.shape)


@triton.jit
def _clamped_swiglu_kernel(G, U, Out, stride_g, stride_u, stride_o, n_cols, limit, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    # The clamped values rounded to the model dtype, as torch's clamp returns them (a limit off its grid rounds)
    g = tl.minimum(tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32), limit)
    g = g.to(Out.dtype.element_ty).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit).to(Out.dtype.element_ty).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)  # silu, rounded as F.silu rounds it
    tl.store(Out + row * stride_o + offs, (s * u).to(Out.dtype.element_ty), mask=mask)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, pdl: bool = False) -> torch.Tensor:
    """silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) (deepseek_v4/moe.clamped_swiglu) in one launch, for
    gate / up (T, I) of one dtype with unit column strides (the two halves of a gate|up product are views)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1 or gate.dtype != up.dtype:
        raise ValueError(f"clamped_swiglu takes two (T, I) tensors of one dtype with unit column strides, got "
                         f"{tuple(gate.shape)} / {tuple(up.shape)}")
    t, n = gate.shape
    out = torch.empty(t, n, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(max(n, 16)))
    if t and n:
        _clamped_swiglu_kernel[(t, triton.cdiv(n, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0),
                                                           n, float(limit), BLOCK=block, num_warps=4, **pdl_launch(pdl))
    return out
