"""DeepSeek-V4's manifold-constrained hyper-connections (models/deepseek_v4/hyper_connections.py) around a block,
in three launches where the torch forms take ~20: the mixes from the perceptron's logits (the pre and post sigmoids
and the Sinkhorn projection of the residual mix, one kernel), the collapse of the N streams into the block input,
and the spread of the block output plus the residual mix back over the streams.

    weights   mix (T, (2 + N) N) fp32 -> pre = sigmoid(mix[:N] s0 + b) + eps, post = 2 sigmoid(mix[N:2N] s1 + b),
              comb = sinkhorn(mix[2N:] s2 + b)                                          (fp32)
              hc_norm_weights: the same from the streams, mix = rms_norm(x) @ fn.T computed as the split products
              x @ fn.T and sums of squares of the unnormalised rows, merged in the weights kernel (two launches)
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


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


HC_SPLIT = 2048
"""Columns of the flattened streams (N * D) one program of the perceptron's product reads (V4-Flash's 16384: 8
programs a block of rows, so a decode batch fills the GPU)."""
HC_BLOCK_T, HC_BLOCK_K = 16, 64


@triton.jit
def _hc_product_kernel(X, W, Part, Sq, num_tokens, k, stride_x, M: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    """Split s of rows x: Part[s] = x[:, cols] @ W[:, cols].T and Sq[s] = sum(x[:, cols]^2), fp32, cols the
    split's SPLIT columns."""
    pdl_wait(PDL)
    s = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < num_tokens
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    acc = tl.zeros([BLOCK_T, BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    for kk in range(0, SPLIT, BLOCK_K):
        offs_k = s * SPLIT + kk + tl.arange(0, BLOCK_K)
        kmask = offs_k < k
        x = tl.load(X + offs_t.to(tl.int64)[:, None] * stride_x + offs_k[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        w = tl.load(W + offs_m[:, None] * k + offs_k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        sq += tl.sum(x * x, 1)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    out = s * num_tokens + offs_t
    tl.store(Part + out.to(tl.int64)[:, None] * M + offs_m[None, :], acc, mask=tmask[:, None] & mmask[None, :])
    tl.store(Sq + out, sq, mask=tmask)


@triton.jit
def _mix_load(ptrs, mask, split_stride, SPLITS: tl.constexpr):
    """The logits at ptrs: one load (SPLITS 0: plain logits) or the sum of the SPLITS partial products, in order."""
    v = tl.load(ptrs, mask=mask, other=0.0)
    for sp in tl.static_range(1, SPLITS):
        v += tl.load(ptrs + sp * split_stride, mask=mask, other=0.0)
    return v


@triton.jit
def _hc_weights_kernel(Mix, Sq, Base, Scale, Pre, Post, Comb, num_tokens, iters, eps, inv_k, norm_eps,
                       N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, SPLITS: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_wait(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < num_tokens
    rows = Mix + offs_t.to(tl.int64)[:, None] * ((2 + N) * N)
    stride = num_tokens * ((2 + N) * N)  # between partial products
    if SPLITS > 0:  # rows' RMS norm, applied to their products: (x @ W.T) * rsqrt(mean(x^2) + eps)
        sq = tl.zeros([BLOCK_T], tl.float32)
        for sp in tl.static_range(SPLITS):
            sq += tl.load(Sq + sp * num_tokens + offs_t, mask=tmask, other=0.0)
        r = tl.rsqrt(sq * inv_k + norm_eps)
    else:
        r = tl.full([BLOCK_T], 1.0, tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    vmask = tmask[:, None] & nmask[None, :]
    s_pre, s_post, s_comb = tl.load(Scale), tl.load(Scale + 1), tl.load(Scale + 2)
    pre = (_mix_load(rows + offs_n[None, :], vmask, stride, SPLITS) * r[:, None] * s_pre
           + tl.load(Base + offs_n, mask=nmask)[None, :])
    post = (_mix_load(rows + N + offs_n[None, :], vmask, stride, SPLITS) * r[:, None] * s_post
            + tl.load(Base + N + offs_n, mask=nmask)[None, :])
    out = offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(Pre + out, _sigmoid(pre) + eps, mask=vmask)
    tl.store(Post + out, 2 * _sigmoid(post), mask=vmask)
    offs_k = tl.arange(0, BLOCK_N)
    inside = nmask[:, None] & (offs_k[None, :] < N)
    cell = offs_n[:, None] * N + offs_k[None, :]
    mask = tmask[:, None, None] & inside[None, :, :]
    logits = (_mix_load(rows[:, :, None] + 2 * N + cell[None, :, :], mask, stride, SPLITS) * r[:, None, None]
              * s_comb + tl.load(Base + 2 * N + cell, mask=inside, other=0.0)[None, :, :])
    comb = sinkhorn_tile(tl.where(mask, logits, float("-inf")), inside, iters, eps)
    tl.store(Comb + offs_t.to(tl.int64)[:, None, None] * (N * N) + cell[None, :, :], comb, mask=mask)


def _launch_weights(mix, sq, splits, k, norm_eps, t, n, base, scale, iters, eps, pdl):
    pre, post = mix.new_empty(t, n), mix.new_empty(t, n)
    comb = mix.new_empty(t, n, n)
    if t:
        _hc_weights_kernel[(triton.cdiv(t, BLOCK_T),)](
            mix, sq, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, t, iters, eps,
            1.0 / k, norm_eps, N=n, BLOCK_N=max(2, triton.next_power_of_2(n)), BLOCK_T=BLOCK_T, SPLITS=splits,
            **pdl_launch(pdl))
    return pre, post, comb


def _check_weights(width: int, base: torch.Tensor, scale: torch.Tensor, iters: int, what: str) -> int:
    n = int(round((1 + width) ** 0.5)) - 1
    if (2 + n) * n != width or base.shape != (width,) or scale.shape != (3,):
        raise ValueError(f"hc_weights: {what}, base {tuple(base.shape)}, scale {tuple(scale.shape)}")
    if iters < 1:
        raise ValueError(f"hc_weights needs at least one Sinkhorn iteration, got {iters}")
    return n


def hc_weights(mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mix (T, (2 + N) N) fp32 logits, base ((2 + N) N,), scale (3,) -> pre (T, N), post (T, N), comb (T, N, N),
    fp32 (the module docstring)."""
    t, width = mix.shape
    n = _check_weights(width, base, scale, iters, f"mix {tuple(mix.shape)}")
    mix = mix.float().contiguous()
    return _launch_weights(mix, mix, 0, 1, 0.0, t, n, base, scale, iters, eps, pdl)


def hc_norm_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                    eps: float, norm_eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_weights of the logits rms_norm(streams.flatten(1).float()) @ fn.T, the norm applied to the product's
    rows (x @ fn.T * rsqrt(mean(x^2) + norm_eps), the same up to rounding), so the normalised fp32 streams are
    never written: streams (T, N, D), fn ((2 + N) N, N D) fp32."""
    t = streams.shape[0]
    x = streams.reshape(t, -1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    k, width = x.shape[1], fn.shape[0]
    if fn.shape != (width, k):
        raise ValueError(f"hc_norm_weights: fn {tuple(fn.shape)} for streams {tuple(streams.shape)}")
    n = _check_weights(width, base, scale, iters, f"fn {tuple(fn.shape)}")
    fn = fn.float().contiguous()
    splits = triton.cdiv(k, HC_SPLIT)
    part = torch.empty(splits, t, width, dtype=torch.float32, device=x.device)
    sq = torch.empty(splits, t, dtype=torch.float32, device=x.device)
    if t:
        _hc_product_kernel[(triton.cdiv(t, HC_BLOCK_T), splits)](
            x, fn, part, sq, t, k, x.stride(0), M=width, BLOCK_M=max(16, triton.next_power_of_2(width)),
            BLOCK_T=HC_BLOCK_T, BLOCK_K=HC_BLOCK_K, SPLIT=HC_SPLIT, num_warps=4, **pdl_launch(pdl))
    return _launch_weights(part, sq, splits, k, norm_eps, t, n, base, scale, iters, eps, pdl)


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
