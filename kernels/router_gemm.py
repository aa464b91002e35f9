"""MoE router logits in one Triton launch: x.float() @ weight.T as fp32 (T, E), x read in its own dtype.

The torch form, F.linear(x.float(), weight), is a cast kernel that writes T*H fp32 and then a cuBLAS sgemm (at
one row a gemv of two kernels). Here each program takes a BLOCK_M-row tile of x and a BLOCK_E-expert tile of the
weight and walks the whole H, converting x to fp32 in registers. Products are full fp32 (fma.rn, never TF32:
which experts win is sensitive to rounding). tl.dot(input_precision="ieee") would give the same products, but
Triton lowers it to CUDA-core FMAs through shared-memory operand layouts: 6-17x slower than cast + cuBLAS at
every T on an H200. So the kernel does the FMAs itself, in a fixed reduction order:

    logit[t, e] = pairwise sum over lanes l < LANES of  lane[l],  lane[l] = fma chain over k = l, l + LANES, ...

No split-K, no atomics, one tile configuration and one compiled kernel for every T (T is not specialised), and
the order above depends on LANES alone: a row's logits are bitwise the same whatever the other rows are and
whatever T is (on an H200 they are even the same for other BLOCK_M / BLOCK_E / num_warps). Each iteration loads
the next K chunk before it multiplies the current one: with no tl.dot in the loop, num_stages does not pipeline
the loads, and without the prefetch decode waits one DRAM round trip per chunk (13.7 against 4.8 us at T = 1).

`router_logits_bf16` is the tensor-core form for bf16 x at prefill sizes: the fp32 weight is held as three bf16
pieces, w = hi + mid + lo to within about 2^-24 |w| (`split_weight`), and each piece is multiplied by x with
tl.dot. A bf16 x bf16 product is exact in fp32 (8 + 8 significant bits), so the logits are the fp32 logits but
for the order of the fp32 adds, as in any sgemm; no TF32 rounding anywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_E, LANES, NUM_WARPS = 16, 4, 128, 4
"""Fixed for every T. BLOCK_E = 4 spreads a decode step over E / 4 programs; wider tiles reuse loads better at
prefill but leave decode to fewer SMs. Graph-timed on an H200 with bf16 x, against cast + cuBLAS: T = 1 takes
4.8 / 9.5 / 12.7 us against 6.2 / 6.6 / 7.6 us at (E, H) = (64, 2048) / (160, 5120) / (256, 7168); T = 8192
takes 148 / 798 / 1708 us against 108 / 479 / 750 us. (tl.dot "ieee" at its best fixed tile: 42 / 103 / 143 us
and 630 / 3800 / 8600 us.)"""


@triton.jit(do_not_specialize=["T"])
def _router_gemm_kernel(X, W, Y, T, E, H, stride_xt, stride_we, NUM_E_BLOCKS, BLOCK_M: tl.constexpr,
                        BLOCK_E: tl.constexpr, LANES: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = (pid // NUM_E_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = (pid % NUM_E_BLOCKS) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, LANES)[None, :]
    mmask = (offs_m < T)[:, None]
    emask = offs_e < E
    rows = offs_m.to(tl.int64)[:, None]  # T * H may pass 2^31
    x_ptrs = X + rows * stride_xt + offs_k
    w_ptrs = W + offs_e[:, None] * stride_we + offs_k
    x = tl.load(x_ptrs, mask=mmask & (offs_k < H), other=0.0)
    w = tl.load(w_ptrs, mask=emask[:, None] & (offs_k < H), other=0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_E, LANES], tl.float32)  # (m, e, lane)
    for k0 in range(LANES, H + LANES, LANES):  # the chunk at k0 (past H: all masked) loads while k0 - LANES runs
        x_next = tl.load(x_ptrs + k0, mask=mmask & (offs_k < H - k0), other=0.0)
        w_next = tl.load(w_ptrs + k0, mask=emask[:, None] & (offs_k < H - k0), other=0.0)
        acc = tl.fma(x.to(tl.float32)[:, None, :], w[None, :, :], acc)
        x, w = x_next, w_next
    tl.store(Y + rows * E + offs_e[None, :], _pairwise_sum(acc, BLOCK_M, BLOCK_E, LANES), mask=mmask & emask[None, :])


@triton.jit
def _pairwise_sum(acc, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, N: tl.constexpr):
    """(BLOCK_M, BLOCK_E, N) -> (BLOCK_M, BLOCK_E): lanes 2i and 2i + 1 added, log2(N) times. Spelled out because
    tl.sum's order follows the register layout."""
    if N == 1:
        return tl.reshape(acc, [BLOCK_M, BLOCK_E])
    else:
        even, odd = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_E, N // 2, 2]))
        return _pairwise_sum(even + odd, BLOCK_M, BLOCK_E, N // 2)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x.float() @ weight.T as a new fp32 (T, E) tensor, for x (T, H) bf16 / fp16 / fp32 with unit column stride
    (T may be 0) and weight (E, H) fp32 with unit column stride. Batch-invariant per row (see the module doc)."""
    t, h = x.shape
    e = weight.shape[0]
    y = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    num_e_blocks = triton.cdiv(e, BLOCK_E)
    _router_gemm_kernel[(triton.cdiv(t, BLOCK_M) * num_e_blocks,)](
        x, weight, y, t, e, h, x.stride(0), weight.stride(0), num_e_blocks, BLOCK_M=BLOCK_M, BLOCK_E=BLOCK_E,
        LANES=LANES, num_warps=NUM_WARPS)
    return y


def split_weight(weight: torch.Tensor) -> torch.Tensor:
    """fp32 (E, H) -> bf16 (3, E, H) pieces [hi, mid, lo] with hi + mid + lo = weight to within about 2^-24 of
    each entry (each piece holds the next 8 significant bits of what the ones before left)."""
    hi = weight.to(torch.bfloat16)
    rest = weight - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack([hi, mid, lo])


@triton.jit
def _router_pieces_kernel(X, P, Y, T, E, H, stride_xt, stride_pp, stride_pe, BLOCK_M: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < T
    emask = offs_e < E
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    w_ptrs = P + offs_e[None, :] * stride_pe + offs_k[:, None]  # (K, E) view of piece 0
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kmask = offs_k < H - k0
        x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        lo = tl.load(w_ptrs + 2 * stride_pp, mask=kmask[:, None] & emask[None, :], other=0.0)
        mid = tl.load(w_ptrs + stride_pp, mask=kmask[:, None] & emask[None, :], other=0.0)
        hi = tl.load(w_ptrs, mask=kmask[:, None] & emask[None, :], other=0.0)
        # A fresh tensor-core sum per K chunk, added to the total on the CUDA cores: the MMA's own accumulation
        # keeps fewer low bits than fp32 adds, which over all of H (chained) cost ~30x sgemm's error at H = 2048.
        acc += tl.dot(x, hi, tl.dot(x, mid, tl.dot(x, lo)))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(Y + offs_m.to(tl.int64)[:, None] * E + offs_e[None, :], acc, mask=mmask[:, None] & emask[None, :])


def router_logits_bf16(x: torch.Tensor, pieces: torch.Tensor) -> torch.Tensor:
    """x (T, H) bf16 with unit column stride, pieces (3, E, H) bf16 from `split_weight` -> fp32 (T, E) logits."""
    t, h = x.shape
    e = pieces.shape[1]
    if x.dtype != torch.bfloat16 or pieces.dtype != torch.bfloat16 or pieces.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError("router_logits_bf16 takes bf16 x and bf16 weight pieces with unit column stride")
    if pieces.dim() != 3 or pieces.shape[0] != 3 or pieces.shape[2] != h:
        raise ValueError(f"router_logits_bf16: pieces {tuple(pieces.shape)} for x of {h} columns, want (3, E, {h})")
    y = torch.empty(t, e, dtype=torch.float32, device=x.device)
    if t == 0:
        return y
    block_e = min(64, max(16, triton.next_power_of_2(e)))
    _router_pieces_kernel[(triton.cdiv(t, 64), triton.cdiv(e, block_e))](
        x, pieces, y, t, e, h, x.stride(0), pieces.stride(0), pieces.stride(1), BLOCK_M=64, BLOCK_E=block_e,
        BLOCK_K=64, num_warps=4, num_stages=3)
    return y
