"""DeepSeek-V4 / V4.1 fixed-shape decode metadata in a few launches (models/deepseek_v4/graph_batch.py).

A CUDA-graph decode step computes its indices on the device from static per-row inputs (position, kv length, page
table row). As torch ops that is ~40 small kernels per compression ratio plus the sliding window's, every step
(about 165 launches of the tiny V4's 566 in `benchmark/count_launches.py --graph`). Here:

    _swa_kernel        one program a row: the sliding window's W recent slots and mask, and the step's own slot
    _entries_kernel    per ratio m, rows x tiles of entries: entry j's main slot // divisor where visible
    _windows_kernel    per ratio m, one program a row: the compression window ending at the row's position

The values are StaticDecode.for_step's torch form, element for element (integers and masks: no rounding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_inputs(Positions, SeqLens, Rows, b):
    """Row b's position (int64), whether it is a real row (kv length > 0) and its page table row (int64)."""
    return tl.load(Positions + b).to(tl.int64), tl.load(SeqLens + b) > 0, tl.load(Rows + b).to(tl.int64)


@triton.jit
def _recent(Table, RecentOfT, row, pos, mask, stride_t, PS: tl.constexpr):
    """The recent page of each position's main page (-1: none), int64."""
    page = tl.load(Table + row * stride_t + pos // PS, mask=mask, other=0).to(tl.int64)
    return tl.load(RecentOfT + page, mask=mask, other=-1)


@triton.jit
def _swa_kernel(Positions, SeqLens, Rows, Table, RecentOfT, Swa, SwaOk, Out, stride_t, pad_recent_slot,
                W: tl.constexpr, BLOCK_W: tl.constexpr, PS: tl.constexpr):
    b = tl.program_id(0)
    p, valid, row = _row_inputs(Positions, SeqLens, Rows, b)
    offs = tl.arange(0, BLOCK_W)
    wmask = offs < W
    k = tl.maximum(p - W + 1, 0) + offs
    ok = (k <= p) & valid
    k = tl.minimum(k, p)
    recent = _recent(Table, RecentOfT, row, k, wmask, stride_t, PS)
    tl.store(Swa + b * W + offs, tl.where(ok & (recent >= 0), recent * PS + k % PS, 0), mask=wmask)
    tl.store(SwaOk + b * W + offs, ok, mask=wmask)
    own = _recent(Table, RecentOfT, row, p, True, stride_t, PS)
    tl.store(Out + b, tl.where(valid & (own >= 0), own * PS + p % PS, pad_recent_slot))


@triton.jit
def _entries_kernel(Positions, SeqLens, Rows, Table, Slots, Visible, stride_t, E,
                    M: tl.constexpr, DIV: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    p, valid, row = _row_inputs(Positions, SeqLens, Rows, b)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jmask = j < E
    visible = (j < (p + 1) // M) & valid
    ends = tl.minimum((j + 1) * M - 1, p)
    page = tl.load(Table + row * stride_t + ends // PS, mask=jmask, other=0).to(tl.int64)
    out = b.to(tl.int64) * E + j
    tl.store(Slots + out, tl.where(visible, (page * PS + ends % PS) // DIV, 0), mask=jmask)
    tl.store(Visible + out, visible, mask=jmask)


@triton.jit
def _windows_kernel(Positions, SeqLens, Rows, Table, RecentOfT, Cur, Prev, HasPrev, First, End, stride_t,
                    pad_entry_row, M: tl.constexpr, BLOCK_M: tl.constexpr, DIV: tl.constexpr, PS: tl.constexpr):
    b = tl.program_id(0)
    p, valid, row = _row_inputs(Positions, SeqLens, Rows, b)
    offs = tl.arange(0, BLOCK_M)
    mmask = offs < M
    first = tl.maximum((p + 1) // M - 1, 0) * M
    pos = first + offs
    cur_pos = tl.minimum(pos, p)
    cur = _recent(Table, RecentOfT, row, cur_pos, mmask, stride_t, PS)
    tl.store(Cur + b * M + offs, tl.where(cur >= 0, cur * PS + cur_pos % PS, 0), mask=mmask)
    prev_pos = tl.minimum(tl.maximum(pos - M, 0), p)
    prev = _recent(Table, RecentOfT, row, prev_pos, mmask, stride_t, PS)
    tl.store(Prev + b * M + offs, tl.where(prev >= 0, prev * PS + prev_pos % PS, 0), mask=mmask)
    tl.store(HasPrev + b, first > 0)
    tl.store(First + b, first)
    page = tl.load(Table + row * stride_t + p // PS).to(tl.int64)
    done = valid & ((p + 1) % M == 0)
    tl.store(End + b, tl.where(done, (page * PS + p % PS) // DIV, pad_entry_row))


def sliding(positions: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
            recent_of_t: torch.Tensor, page_size: int, window: int, pad_recent_slot: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(window slots (B, W) int64, their mask (B, W) bool, the step's own slot (B,) int64)."""
    bsz = positions.shape[0]
    swa = torch.empty(bsz, window, dtype=torch.int64, device=positions.device)
    ok = torch.empty(bsz, window, dtype=torch.bool, device=positions.device)
    out = torch.empty(bsz, dtype=torch.int64, device=positions.device)
    if bsz:
        _swa_kernel[(bsz,)](positions, seq_lens, rows, table, recent_of_t, swa, ok, out, table.stride(0),
                            pad_recent_slot, W=window, BLOCK_W=triton.next_power_of_2(window), PS=page_size)
    return swa, ok, out


def entries(positions: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
            page_size: int, ratio: int, divisor: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(entry slots (B, count) int64, visible (B, count) bool) of one compression ratio."""
    bsz = positions.shape[0]
    slots = torch.empty(bsz, count, dtype=torch.int64, device=positions.device)
    visible = torch.empty(bsz, count, dtype=torch.bool, device=positions.device)
    if bsz and count:
        block = min(1024, triton.next_power_of_2(count))
        _entries_kernel[(bsz, triton.cdiv(count, block))](positions, seq_lens, rows, table, slots, visible,
                                                           table.stride(0), count, M=ratio, DIV=divisor,
                                                           PS=page_size, BLOCK=block)
    return slots, visible


def windows(positions: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
            recent_of_t: torch.Tensor, page_size: int, ratio: int, divisor: int, pad_entry_row: int
            ) -> tuple[torch.Tensor, ...]:
    """(cur (B, m), prev (B, m), has_prev (B,) bool, first (B,), end (B,)) of the window ending at each row's
    position, int64 but has_prev."""
    bsz, dev = positions.shape[0], positions.device
    cur = torch.empty(bsz, ratio, dtype=torch.int64, device=dev)
    prev = torch.empty(bsz, ratio, dtype=torch.int64, device=dev)
    has_prev = torch.empty(bsz, dtype=torch.bool, device=dev)
    first = torch.empty(bsz, dtype=torch.int64, device=dev)
    end = torch.empty(bsz, dtype=torch.int64, device=dev)
    if bsz:
        _windows_kernel[(bsz,)](positions, seq_lens, rows, table, recent_of_t, cur, prev, has_prev, first, end,
                                table.stride(0), pad_entry_row, M=ratio, BLOCK_M=triton.next_power_of_2(ratio),
                                DIV=divisor, PS=page_size)
    return cur, prev, has_prev, first, end
