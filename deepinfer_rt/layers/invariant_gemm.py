"""Batch-invariant GEMM on CPU: a row of x @ w_t is bitwise the same whatever rows share its call.

The BLAS picks its kernel, blocking and thread split from the shape, so one call of (M, K) @ (K, N) rounds a
row differently for different M. Here a matmul is cut into calls of a few fixed row counts only, each
zero-padded to its size:

    x rows   [0, L) [L, 2L) ... | [.., +S) ... [.., +S)    L: the bulk size, S: the tail size (per call count)
             bulk calls           tail calls

Each call is torch.mm(w, x_tile.T): its (N, R) result has one column per token, and the calls' columns make
one (N, padded T) result, copied row-major once at the end (tiled_mm_with) or handed on as columns to a next
GEMM that takes its inputs so (the columns form, tiled_mm_cols_with: a gated MLP's down projection). Under MKL
this orientation rounds a token the same for 2-512-row calls on the shapes measured, where x_tile @ w.T
disagreed below 16 rows and ran K = 1536 at 16 rows 3.3x slower than at 8.

A call of one shape is invariant by construction. That a row comes out the same from calls of different row
counts is a property of the BLAS's choices for (N, K), so it is checked once per weight shape on random data
(every row position, two offsets): the plan's sizes are those of TILE_SIZES whose rows agree with calls of
REFERENCE_TILE rows (at 2 threads MKL disagrees, for example, at 64-192 rows for K = 1536 in the columns
form). Where no size of 64 rows or
more agrees over the whole K, K is cut into fixed K_CHUNK slices whose partial products are added in slice
order, and the sizes are checked again that way; failing that too, the plan keeps the whole K and the sizes
that agree (the small ones).

Since the plan's sizes all give the same bits, which of them a batch uses is free: T rows take calls of the
largest size, then the rest in calls of the one size that costs least by a fixed model (each call streams the
weight once, worth CALL_ROWS rows). Only the agreement checks, whose order is fixed, decide the bits, so a
process with the same BLAS and thread count computes the same values on every run.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

REFERENCE_TILE = 16
"""Row count every other call size must agree with (and the smallest that does for every shape seen)."""
TILE_SIZES = (2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 512)
"""Candidate rows per call; the many sizes of 48 or more let a prefill chunk take one call of little padding
(298 rows: one call of 320, not 256 + 64: each call streams the weight once)."""
LARGE_WEIGHT = 1 << 24
"""Weights of more elements (an LM head) try sizes up to 256 only: their checks cost seconds at 512 rows, and
they see a few rows per sequence."""
K_CHUNK = 512
"""Inner-dim slice when the whole K agrees at no bulk size (no split-K by the BLAS at this depth)."""
CALL_ROWS = 32
"""What one call costs beside its rows, in rows: each call streams the whole weight once."""


@dataclass(frozen=True)
class GemmPlan:
    tiles: tuple[int, ...]  # rows per call, ascending, each agreeing with REFERENCE_TILE rows for this shape
    k_chunk: int  # inner-dim slice per call; slices added in ascending order

    def cover(self, t: int) -> tuple[int, ...]:
        """Call sizes for t rows, in order (the last ones zero-padded)."""
        return _cover(self.tiles, t)


@functools.lru_cache(maxsize=4096)
def _cover(tiles: tuple[int, ...], t: int) -> tuple[int, ...]:
    """Calls of the largest size, then the rest in calls of one size, the one of least
    calls * CALL_ROWS + padded rows."""
    bulk = tiles[-1]
    rest = t % bulk
    sizes = (bulk,) * (t // bulk)
    if rest:
        size = min(tiles, key=lambda size: (-(-rest // size) * (CALL_ROWS + size), size))
        sizes += (size,) * -(-rest // size)
    return sizes


def _call(x_tile: torch.Tensor, w: torch.Tensor, k_chunk: int) -> torch.Tensor:
    """One fixed-shape call: w (N, K) @ x_tile (R, K).T -> (N, R), as a sum over K slices in ascending order."""
    k = x_tile.shape[1]
    if k_chunk >= k:
        return torch.mm(w, x_tile.t())
    out_t = torch.mm(w[:, :k_chunk], x_tile[:, :k_chunk].t())
    for k0 in range(k_chunk, k, k_chunk):
        out_t += torch.mm(w[:, k0 : k0 + k_chunk], x_tile[:, k0 : k0 + k_chunk].t())
    return out_t


def tiled_mm_with(x: torch.Tensor, w_t: torch.Tensor, plan: GemmPlan) -> torch.Tensor:
    """x (T, K) @ w_t (K, N) -> (T, N) in calls of the plan's sizes. x is zero-padded once to the calls' total
    rows; the calls give columns of one (N, padded T) result, copied row-major once at the end. (Few torch ops:
    on a small CPU each costs microseconds, about what a decode step's small GEMM does.)"""
    t = x.shape[0]
    if t == 0:  # an expert-parallel rank with no tokens this step
        return x.new_empty(0, w_t.shape[1])
    return _columns(x, w_t, plan, t, cols=False)[:, :t].t().contiguous()


def tiled_mm_cols_with(xt: torch.Tensor, w_t: torch.Tensor, plan: GemmPlan, t: int) -> torch.Tensor:
    """The columns form: xt (K, >= t) holds the inputs as columns (its first t are real, e.g. another
    GEMM's output as it comes); returns w_t.T @ xt (N, padded t) in calls of the plan's sizes, the columns past
    t zero-input padding. No transposes: a gated MLP chains its GEMMs through it."""
    return _columns(xt, w_t, plan, t, cols=True)


def _columns(x: torch.Tensor, w_t: torch.Tensor, plan: GemmPlan, t: int, cols: bool) -> torch.Tensor:
    """(N, padded t) = w_t.T @ the t inputs, given as rows of x (T, K), or as columns of x (K, >= t)."""
    sizes = plan.cover(t)
    padded_t = sum(sizes)
    if cols:
        x = x[:, :t]
        x = F.pad(x, (0, padded_t - t)) if padded_t != t else x.contiguous()
        tile = lambda row, size: x[:, row : row + size].t()  # noqa: E731
    else:
        x = F.pad(x, (0, 0, 0, padded_t - t)) if padded_t != t else x.contiguous()
        tile = lambda row, size: x[row : row + size]  # noqa: E731
    w = w_t.t()
    if len(sizes) == 1:  # a decode step: one call
        return _call(tile(0, padded_t), w, plan.k_chunk)
    starts = itertools.accumulate(sizes, initial=0)
    return torch.cat([_call(tile(row, size), w, plan.k_chunk) for row, size in zip(starts, sizes)], dim=1)


def tiled_mm(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    return tiled_mm_with(x, w_t, plan_for(w_t))


def tiled_mm_to_cols(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """tiled_mm's result as the calls give it, columns: (N, padded T), the columns past T from zero rows."""
    return _columns(x, w_t, plan_for(w_t), x.shape[0], cols=False)


def tiled_mm_cols(xt: torch.Tensor, w_t: torch.Tensor, t: int) -> torch.Tensor:
    return tiled_mm_cols_with(xt, w_t, plan_for(w_t, cols=True), t)


def plan_for(w_t: torch.Tensor, cols: bool = False) -> GemmPlan:
    k, n = w_t.shape
    return _plan(n, k, w_t.dtype, w_t.t().is_contiguous(), torch.get_num_threads(), cols)


@functools.cache
def _plan(n: int, k: int, dtype: torch.dtype, weight_rows_contiguous: bool, num_threads: int,
          cols: bool = False) -> GemmPlan:
    """The sizes agreeing with REFERENCE_TILE on random data (weights laid out as the caller's, inputs as rows
    or as columns), over the whole K if a bulk size (>= 64) is among them, else over K slices if one is then,
    else the whole K's."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    w_t = w.t() if weight_rows_contiguous else w.t().contiguous()
    sizes = TILE_SIZES if n * k <= LARGE_WEIGHT else tuple(size for size in TILE_SIZES if size <= 256)
    x = torch.randn(max(sizes), k, generator=gen).to(dtype)
    whole = None
    for k_chunk in (k, K_CHUNK) if k > K_CHUNK else (k,):
        tiles = agreeing_sizes(x, w_t, k_chunk, sizes, cols)
        whole = whole or tiles
        if tiles[-1] >= 64:
            break
    else:
        k_chunk, tiles = k, whole
    return GemmPlan(tiles, k_chunk)


def agreeing_sizes(x: torch.Tensor, w_t: torch.Tensor, k_chunk: int, sizes: tuple[int, ...],
                   cols: bool = False) -> tuple[int, ...]:
    """The sizes (and REFERENCE_TILE) whose calls give every row of x (R, K) as REFERENCE_TILE-row calls do,
    with the rows at two offsets in the calls; cols: x passed as columns (tiled_mm_cols_with)."""

    def run(xi: torch.Tensor, plan: GemmPlan) -> torch.Tensor:
        if cols:
            return tiled_mm_cols_with(xi.t().contiguous(), w_t, plan, len(xi))[:, : len(xi)]
        return tiled_mm_with(xi, w_t, plan)

    shift = REFERENCE_TILE // 2 - 1
    xs = (x, x.roll(shift, 0))
    refs = [run(xi, GemmPlan((REFERENCE_TILE,), k_chunk)) for xi in xs]

    def agrees(size: int) -> bool:  # on the first rows that hold whole calls of both sizes, at least 48
        rows = min(len(x), -(-max(size, 3 * REFERENCE_TILE) // size) * size)
        return all(torch.equal(run(xi[:rows], GemmPlan((size,), k_chunk)), ref[:rows] if not cols else ref[:, :rows])
                   for xi, ref in zip(xs, refs))

    return tuple(size for size in sorted({*sizes, REFERENCE_TILE}) if size == REFERENCE_TILE or agrees(size))


def tiles_agree(x: torch.Tensor, w_t: torch.Tensor, k_chunk: int, size: int) -> bool:
    """Each row of x equal from calls of `size` rows and from calls of REFERENCE_TILE rows, at two offsets."""
    return size in agreeing_sizes(x, w_t, k_chunk, (size,))
