"""DeepSeek-V4's manifold-constrained hyper-connections (models/deepseek_v4/hyper_connections.py) around a block,
in five launches where the torch forms take ~20: the mix logits (two), the mixes from the perceptron's logits (the
pre and post sigmoids and the Sinkhorn projection of the residual mix, one kernel), the collapse of the N streams
into the block input, and the spread of the block output plus the residual mix back over the streams.

    logits    streams (T, N D) -> mix = rms_norm(streams) @ fn.T (T, M) fp32: one pass over the streams (their sum
              of squares and the M dot products together, K split over programs, partials summed in split order),
              instead of an fp32 copy of the normalized streams and an fp32 GEMM with M = (2 + N) N columns
    weights   mix (T, (2 + N) N) fp32 -> pre = sigmoid(mix[:N] s0 + b) + eps, post = 2 sigmoid(mix[N:2N] s1 + b),
              comb = sinkhorn(mix[2N:] s2 + b)                                          (fp32)
    collapse  x (T, D) = sum_j pre[j] streams[j]                 (fp32 sum in stream order, one cast)
    expand    out[k] = post[k] y + sum_j comb[j, k] streams[j]   (each term rounded to the streams' dtype as the
              torch form's bf16 products and sum round, the inner sum in fp32)

Results agree with the torch forms to rounding (exp-based sigmoids, summation order), not bitwise; the
batch-invariant methods keep the torch forms.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_kernels.dispatch import pdl_launch, pdl_wait

from deepinfer_kernels.v4_sinkhorn import BLOCK_T, sinkhorn_tile

BLOCK_D = 1024
"""Columns of D per collapse / expand program."""
LOGITS_BLOCK_K = {torch.float32: 32}
"""Inputs a logits program reads per step, by the streams' dtype (64 otherwise): the largest whose sm90 builds
keep every value in registers at both token blocks and either weight dtype (Triton 3.6; fp32 streams with bf16
weights spill 152-1,472 bytes a thread at 64-128; benchmark/results/sass_sm90_w16_hc_logits.txt)."""
LOGITS_PROGRAMS = 264
"""About how many logits programs a call launches (two a multiprocessor of an H100 / H200): K is split over as
many programs as the token blocks leave room for."""


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _hc_weights_kernel(Mix, Base, Scale, Pre, Post, Comb, num_tokens, iters, eps, N: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < num_tokens
    rows = Mix + offs_t.to(tl.int64)[:, None] * ((2 + N) * N)
    offs_n = tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    vmask = tmask[:, None] & nmask[None, :]
    s_pre, s_post, s_comb = tl.load(Scale), tl.load(Scale + 1), tl.load(Scale + 2)
    pre = tl.load(rows + offs_n[None, :], mask=vmask, other=0.0) * s_pre + tl.load(Base + offs_n, mask=nmask)[None, :]
    post = (tl.load(rows + N + offs_n[None, :], mask=vmask, other=0.0) * s_post
            + tl.load(Base + N + offs_n, mask=nmask)[None, :])
    out = offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(Pre + out, _sigmoid(pre) + eps, mask=vmask)
    tl.store(Post + out, 2 * _sigmoid(post), mask=vmask)
    offs_k = tl.arange(0, BLOCK_N)
    inside = nmask[:, None] & (offs_k[None, :] < N)
    cell = offs_n[:, None] * N + offs_k[None, :]
    mask = tmask[:, None, None] & inside[None, :, :]
    logits = (tl.load(rows[:, :, None] + 2 * N + cell[None, :, :], mask=mask, other=0.0) * s_comb
              + tl.load(Base + 2 * N + cell, mask=inside, other=0.0)[None, :, :])
    comb = sinkhorn_tile(tl.where(mask, logits, float("-inf")), inside, iters, eps)
    tl.store(Comb + offs_t.to(tl.int64)[:, None, None] * (N * N) + cell[None, :, :], comb, mask=mask)


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix (T, (2 + N) N) fp32 logits, base ((2 + N) N,), scale (3,) -> pre (T, N), post (T, N), comb (T, N, N),
    fp32 (the module docstring)."""
    t, width = mix.shape
    n = int(round((1 + width) ** 0.5)) - 1
    if (2 + n) * n != width or base.shape != (width,) or scale.shape != (3,):
        raise ValueError(f"hc_weights: mix {tuple(mix.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)}")
    if iters < 1:
        raise ValueError(f"hc_weights needs at least one Sinkhorn iteration, got {iters}")
    mix = mix.float().contiguous()
    pre, post = mix.new_empty(t, n), mix.new_empty(t, n)
    comb = mix.new_empty(t, n, n)
    if t:
        _hc_weights_kernel[(triton.cdiv(t, BLOCK_T),)](mix, base.float().contiguous(), scale.float().contiguous(),
                                                      pre, post, comb, t, iters, eps, N=n,
                                                      BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_T=BLOCK_T,
                                                      **pdl_launch(pdl))
    return pre, post, comb


@triton.jit
def _hc_collapse_kernel(Pre, Streams, Out, stride_st, stride_sj, stride_ot, d, N: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(N):
        w = tl.load(Pre + t * N + j)
        acc += w * tl.load(Streams + t * stride_st + j * stride_sj + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_ot + offs, acc.to(Out.dtype.element_ty), mask=mask)


def hc_collapse(pre: torch.Tensor, streams: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """pre (T, N) fp32, streams (T, N, D) -> sum_j pre[:, j] streams[:, j] (T, D) in the streams' dtype."""
    t, n, d = streams.shape
    if pre.shape != (t, n):
        raise ValueError(f"hc_collapse: pre {tuple(pre.shape)} for streams {tuple(streams.shape)}")
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    pre = pre.float().contiguous()
    out = streams.new_empty(t, d)
    if t:
        _hc_collapse_kernel[(t, triton.cdiv(d, BLOCK_D))](pre, streams, out, streams.stride(0), streams.stride(1),
                                                         out.stride(0), d, N=n, BLOCK=BLOCK_D, **pdl_launch(pdl))
    return out


@triton.jit
def _hc_expand_kernel(Post, Y, Comb, Streams, Out, stride_yt, stride_st, stride_sj, d, N: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    dtype = Out.dtype.element_ty
    y = tl.load(Y + t * stride_yt + offs, mask=mask, other=0.0).to(tl.float32)
    rows = Streams + t * stride_st + offs
    for k in tl.static_range(N):
        mixed = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(N):
            c = tl.load(Comb + (t * N + j) * N + k).to(dtype).to(tl.float32)
            mixed += c * tl.load(rows + j * stride_sj, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(Post + t * N + k).to(dtype).to(tl.float32)
        spread = (p * y).to(dtype).to(tl.float32)
        out = spread + mixed.to(dtype).to(tl.float32)
        tl.store(Out + t * (N * d) + k * d + offs, out.to(dtype), mask=mask)


def hc_expand(post: torch.Tensor, y: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor,
              pdl: bool = False) -> torch.Tensor:
    """post (T, N) and comb (T, N, N) fp32, y (T, D), streams (T, N, D) -> (T, N, D) in the streams' dtype:
    post[:, k] y + sum_j comb[:, j, k] streams[:, j]."""
    t, n, d = streams.shape
    if post.shape != (t, n) or comb.shape != (t, n, n) or y.shape != (t, d) or y.dtype != streams.dtype:
        raise ValueError(f"hc_expand: post {tuple(post.shape)}, comb {tuple(comb.shape)}, y {tuple(y.shape)} "
                         f"{y.dtype} for streams {tuple(streams.shape)} {streams.dtype}")
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    if y.stride(-1) != 1:
        y = y.contiguous()
    post, comb = post.float().contiguous(), comb.float().contiguous()
    out = streams.new_empty(t, n, d)
    if t:
        _hc_expand_kernel[(t, triton.cdiv(d, BLOCK_D))](post, y, comb, streams, out, y.stride(0), streams.stride(0),
                                                       streams.stride(1), d, N=n, BLOCK=BLOCK_D, **pdl_launch(pdl))
    return out


@triton.jit
def _hc_logits_partial_kernel(X, W, Part, SumSq, num_tokens, m, k, steps_per_split, stride_xt, stride_wm,
                              BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                              PDL: tl.constexpr):
    """Part[s, t, :m] = x[t, K_s] @ w[:, K_s].T and SumSq[s, t] = sum x[t, K_s]^2 over split s's inputs K_s."""
    pdl_wait(PDL)
    pid_t, split = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    tmask, mmask = offs_t < num_tokens, offs_m < m
    acc = tl.zeros([BLOCK_T, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for step in range(steps_per_split):
        kk = (split * steps_per_split + step) * BLOCK_K + offs_k
        kmask = kk < k
        x = tl.load(X + offs_t.to(tl.int64)[:, None] * stride_xt + kk[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(W + offs_m[:, None] * stride_wm + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        ss += tl.sum(x * x, axis=1)
        acc = tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    base = split.to(tl.int64) * num_tokens + offs_t
    tl.store(Part + base[:, None] * BLOCK_M + offs_m[None, :], acc, mask=tmask[:, None])
    tl.store(SumSq + base, ss, mask=tmask)


@triton.jit
def _hc_logits_finish_kernel(Part, SumSq, Out, num_tokens, m, k, splits, eps, BLOCK_T: tl.constexpr,
                             BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_s Part[s, t] * rsqrt(sum_s SumSq[s, t] / k + eps), the splits summed in order."""
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, BLOCK_M)
    tmask = offs_t < num_tokens
    acc = tl.zeros([BLOCK_T, BLOCK_M], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for split in range(splits):
        base = split * num_tokens + offs_t.to(tl.int64)
        acc += tl.load(Part + base[:, None] * BLOCK_M + offs_m[None, :], mask=tmask[:, None], other=0.0)
        ss += tl.load(SumSq + base, mask=tmask, other=0.0)
    out = acc * (1.0 / tl.sqrt(ss / k + eps))[:, None]
    tl.store(Out + offs_t.to(tl.int64)[:, None] * m + offs_m[None, :], out,
             mask=tmask[:, None] & (offs_m[None, :] < m))


def hc_logits(x: torch.Tensor, w: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """x (T, K) (the flattened streams, any float dtype), w (M, K) -> unweighted_rms_norm(x.float()) @ w.float().T,
    (T, M) fp32 (to rounding: the norm's scale applies to the sums, which add in another order)."""
    t, k = x.shape
    m = w.shape[0]
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"hc_logits: weights {tuple(w.shape)} for inputs {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = torch.empty(t, m, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    block_t = 16 if t <= 64 else 32
    block_m = max(16, triton.next_power_of_2(m))
    block_k = LOGITS_BLOCK_K.get(x.dtype, 64)
    t_blocks, steps = triton.cdiv(t, block_t), triton.cdiv(k, block_k)
    splits = max(1, min(steps, LOGITS_PROGRAMS // t_blocks))
    steps_per_split = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, steps_per_split)
    part = torch.empty(splits, t, block_m, dtype=torch.float32, device=x.device)
    sumsq = torch.empty(splits, t, dtype=torch.float32, device=x.device)
    _hc_logits_partial_kernel[(t_blocks, splits)](x, w, part, sumsq, t, m, k, steps_per_split, x.stride(0),
                                                  w.stride(0), BLOCK_T=block_t, BLOCK_M=block_m,
                                                  BLOCK_K=block_k, **pdl_launch(pdl))
    _hc_logits_finish_kernel[(t_blocks,)](part, sumsq, out, t, m, k, splits, eps, BLOCK_T=block_t,
                                          BLOCK_M=block_m, **pdl_launch(pdl))
    return out
