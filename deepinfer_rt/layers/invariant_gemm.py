"""Batch-invariant GEMM on CPU: a row of x @ w_t is bitwise the same whatever rows share its call.

The BLAS picks its kernel, blocking and thread split from the shape, so one call of (M, K) @ (K, N) rounds a
row differently for different M. Here a matmul is cut into calls of a few fixed shapes only:

    x rows   [0, L) [L, 2L) ... | [.., +S) ... [.., +S)    L = LARGE_TILE, S = SMALL_TILE; the last small tile
             large tiles          small tiles                is zero-padded to S rows

Each call is weight-major for the BLAS: torch.mm(x_tile, w_t) with w_t = w.t() writes the row-major (R, N)
result, which the column-major BLAS sees as w (N, K) @ x_tile.T (K, R), so the batch is its narrow n dimension,
walked in fixed column blocks with the whole K loop per block: a column (token) does not depend on its
neighbours, and R = 16 columns cost about a GEMV-like call (decode pays no padding penalty). Each tile's result
is written straight into its rows of the output (no transposed copies).

A call of one shape is invariant by construction; that a row comes out the same from a large tile and from a
small one is a property of the BLAS's choices for (N, K), so it is checked once per shape on random data
(every row position of both tile sizes) before large tiles are used. Where it fails, K is cut into fixed
K_CHUNK slices whose partial products are added in slice order (the BLAS splits a long K across threads for
some M, which is what breaks it), and that form is checked the same way; failing both, every call is small.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SMALL_TILE = 16
"""Columns per small call. 16 costs about what 1..8 do weight-major, and keeps decode batches in one call."""
LARGE_TILE = 128
"""Columns per large call: each weight read serves 128 tokens in prefill (cost per row as for one big call)."""
K_CHUNK = 512
"""Inner-dim slice when the whole K is not tile-size invariant (no split-K by the BLAS at this depth)."""


@dataclass(frozen=True)
class GemmPlan:
    use_large: bool  # large tiles give the same rows as small ones for this shape
    k_chunk: int  # inner-dim slice per call; slices added in ascending order


def _call(x_tile: torch.Tensor, w_t: torch.Tensor, k_chunk: int, out: torch.Tensor) -> None:
    """One fixed-shape call: out (R, N) = x_tile (R, K) @ w_t (K, N), as a sum over K slices in ascending order."""
    k = x_tile.shape[1]
    if k_chunk >= k:
        torch.mm(x_tile, w_t, out=out)
        return
    torch.mm(x_tile[:, :k_chunk], w_t[:k_chunk], out=out)
    for k0 in range(k_chunk, k, k_chunk):
        out += torch.mm(x_tile[:, k0 : k0 + k_chunk], w_t[k0 : k0 + k_chunk])


def tiled_mm_with(x: torch.Tensor, w_t: torch.Tensor, plan: GemmPlan) -> torch.Tensor:
    """x (T, K) @ w_t (K, N) -> (T, N) in calls of the plan's fixed shapes. The rows past the large tiles are
    zero-padded to whole small tiles, and the result is the first T rows of the padded output (no copy back)."""
    t = x.shape[0]
    start = t - t % LARGE_TILE if plan.use_large else 0
    padded_t = start + -(-(t - start) // SMALL_TILE) * SMALL_TILE
    if padded_t == t:
        x = x.contiguous()
    else:
        x = torch.cat([x, x.new_zeros(padded_t - t, x.shape[1])])
    out = x.new_empty(padded_t, w_t.shape[1])
    for row in range(0, start, LARGE_TILE):
        _call(x[row : row + LARGE_TILE], w_t, plan.k_chunk, out[row : row + LARGE_TILE])
    for row in range(start, padded_t, SMALL_TILE):
        _call(x[row : row + SMALL_TILE], w_t, plan.k_chunk, out[row : row + SMALL_TILE])
    return out[:t]


def tiled_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    return tiled_mm_with(x, w_t, plan_for(w_t))


def plan_for(w_t: torch.Tensor) -> GemmPlan:
    k, n = w_t.shape
    return _plan(n, k, w_t.dtype, w_t.t().is_contiguous(), torch.get_num_threads())


@functools.cache
def _plan(n: int, k: int, dtype: torch.dtype, weight_rows_contiguous: bool, num_threads: int) -> GemmPlan:
    """Large tiles if they agree with small ones on random data (weights laid out as the caller's)."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    w_t = w.t() if weight_rows_contiguous else w.t().contiguous()
    x = torch.randn(LARGE_TILE, k, generator=gen).to(dtype)
    for k_chunk in (k, K_CHUNK) if k > K_CHUNK else (k,):
        if tiles_agree(x, w_t, k_chunk):
            return GemmPlan(use_large=True, k_chunk=k_chunk)
    return GemmPlan(use_large=False, k_chunk=k)


def tiles_agree(x: torch.Tensor, w_t: torch.Tensor, k_chunk: int) -> bool:
    """x (LARGE_TILE, K): each row equal from the large call and from small calls, at two offsets in them."""
    large = tiled_mm_with(x, w_t, GemmPlan(use_large=True, k_chunk=k_chunk))
    small = GemmPlan(use_large=False, k_chunk=k_chunk)
    shift = SMALL_TILE // 2 - 1
    return (torch.equal(large, tiled_mm_with(x, w_t, small))
            and torch.equal(large.roll(shift, 0), tiled_mm_with(x.roll(shift, 0), w_t, small)))
