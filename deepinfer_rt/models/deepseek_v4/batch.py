"""Per-step index tensors of DeepSeek-V4 attention, built once from a ForwardBatch and shared by all layers.

A query at position p of a sequence attends to
  * the sliding-window keys of positions p - W + 1 .. p, and
  * the compressed entries of the complete windows w < (p + 1) // m (window w covers positions
    w*m .. (w+1)*m - 1; its entry lives in the slot of position (w+1)*m - 1), all of them for HCA, the
    indexer's top-k of them for CSA.
Queries are processed in groups that share one padded key set: each block of up to `query_block` consecutive
queries of an extend (prefill chunk) sequence is a group, which bounds the score tensor of a long chunk; all decode
sequences form one group of single queries. Windows whose last token is in
this step are compressed first, for every sequence at once.

Two slot spaces: per-token state (sliding keys, compressor inputs) is read at `recent` slots, entries at entry
rows (a main slot divided by the ratio's divisor). In the per-token layout both are the main slots; the compact
pool (models/deepseek_v4/cache.py) gives each its own buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_rt.forward_batch import ForwardBatch


@dataclass
class AttnGroup:
    rows: torch.Tensor
    """(G * Q,) token rows of the queries, sequence-major."""
    num_seqs: int
    q_len: int
    swa_slots: torch.Tensor
    """(G, L) slots of the sliding-window keys, padded with slot 0."""
    swa_mask: torch.Tensor
    """(G, Q, L) True = attend."""
    entry_slots: dict[int, torch.Tensor]
    """ratio -> (G, E) slots holding the compressed entries 0 .. E-1 (padded)."""
    entry_mask: dict[int, torch.Tensor]
    """ratio -> (G, Q, E) causal visibility of each entry to each query."""
    covers_all: bool = False
    """`rows` are all the step's token rows in order (a step of one group: decode only, or one prompt's chunk), so
    the group's rows of a step tensor are the tensor itself: no gather, no scatter of the output."""

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The group's rows of a step tensor (T, ...)."""
        return t if self.covers_all else t[self.rows]


@dataclass
class Windows:
    """Compression windows completed in this step, over all sequences (N windows of `ratio` tokens)."""

    cur: torch.Tensor
    """(N, ratio) slots of the window's tokens."""
    prev: torch.Tensor
    """(N, ratio) slots of the previous window's tokens (the window itself for window 0)."""
    has_prev: torch.Tensor
    """(N,) False for window 0."""
    positions: torch.Tensor
    """(N,) position of the window's first token (its entry's RoPE position)."""
    end: torch.Tensor
    """(N,) entry row of the window (from the slot of its last token), where its entry is written."""

    @property
    def num(self) -> int:
        return int(self.end.shape[0])


@dataclass
class V4Batch:
    positions: torch.Tensor
    out_slots: torch.Tensor
    """(T,) recent slots of the new tokens (their sliding keys and compressor inputs)."""
    input_ids: torch.Tensor
    groups: list[AttnGroup]
    windows: dict[int, Windows]

    def for_step(self) -> "V4Batch":
        """The step's indices: built already (a CUDA-graph step's StaticDecode computes them here instead)."""
        return self


def _entries(slots: torch.Tensor, kv_len: int, ratio: int, divisor: int) -> torch.Tensor:
    return slots[ratio - 1 : (kv_len // ratio) * ratio : ratio] // divisor


def _pad(rows: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D slot tensors, padding with slot 0; returns (G, L) slots and (G, L) validity."""
    width = max(1, max(len(r) for r in rows))
    out = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    valid = torch.zeros(len(rows), width, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        valid[i, : len(r)] = True
    return out, valid


def _extend_group(row: int, start: int, kv_len: int, slots: torch.Tensor, recent: torch.Tensor, window: int,
                  divisors: dict[int, int]) -> AttnGroup:
    device = slots.device
    q_pos = torch.arange(start, kv_len, device=device)[:, None]
    k0 = max(0, start - window + 1)
    k_pos = torch.arange(k0, kv_len, device=device)[None, :]
    swa_mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    entry_slots, entry_mask = {}, {}
    for m, div in divisors.items():
        entry_slots[m] = _entries(slots, kv_len, m, div)[None]
        e = torch.arange(entry_slots[m].shape[1], device=device)[None, :]
        entry_mask[m] = (e < (q_pos + 1) // m)[None]
    q_len = kv_len - start
    return AttnGroup(torch.arange(row, row + q_len, device=device), 1, q_len, recent[k0:kv_len][None],
                     swa_mask[None], entry_slots, entry_mask)


def _decode_group(rows: list[int], kv_lens: list[int], slots: list[torch.Tensor], recent: list[torch.Tensor],
                  window: int, divisors: dict[int, int], device: torch.device) -> AttnGroup:
    swa_slots, swa_valid = _pad([s[max(0, n - window) : n] for s, n in zip(recent, kv_lens)], device)
    entry_slots, entry_mask = {}, {}
    for m, div in divisors.items():
        entry_slots[m], valid = _pad([_entries(s, n, m, div) for s, n in zip(slots, kv_lens)], device)
        entry_mask[m] = valid[:, None, :]
    return AttnGroup(torch.tensor(rows, device=device), len(rows), 1, swa_slots, swa_valid[:, None, :],
                     entry_slots, entry_mask)


def _windows(batch: ForwardBatch, recent: list[torch.Tensor], ratio: int, divisor: int) -> Windows:
    device = batch.input_ids.device
    offsets = torch.arange(ratio, device=device)
    cur, prev, first, end = [], [], [], []
    for q_len, kv_len, slots, rslots in zip(batch.q_lens, batch.kv_lens, batch.kv_slots, recent):
        w = torch.arange((kv_len - q_len) // ratio, kv_len // ratio, device=device)
        idx = w[:, None] * ratio + offsets
        cur.append(rslots[idx])
        prev.append(rslots[(idx - ratio).clamp(min=0)])
        first.append(w * ratio)
        end.append(slots[idx[:, -1]] // divisor)
    cur_t, prev_t, first_t = torch.cat(cur), torch.cat(prev), torch.cat(first)
    return Windows(cur_t, prev_t, first_t > 0, first_t, torch.cat(end))


def build_v4_batch(batch: ForwardBatch, window: int, ratios: tuple[int, ...], query_block: int,
                   recent: list[torch.Tensor] | None = None, divisors: dict[int, int] | None = None) -> V4Batch:
    """`recent`: each sequence's recent slot of every position (default: its main slots); `divisors`: ratio ->
    main slot // divisor = entry row (default 1)."""
    device = batch.input_ids.device
    recent = batch.kv_slots if recent is None else recent
    divisors = {m: 1 for m in ratios} if divisors is None else {m: divisors[m] for m in ratios}
    groups, decode = [], ([], [], [], [])
    row = 0
    out_slots = []
    for q_len, kv_len, slots, rslots in zip(batch.q_lens, batch.kv_lens, batch.kv_slots, recent):
        out_slots.append(rslots[kv_len - q_len : kv_len])
        if q_len == 1:
            for acc, value in zip(decode, (row, kv_len, slots, rslots)):
                acc.append(value)
        else:
            start = kv_len - q_len
            for block_start in range(start, kv_len, query_block):
                block_end = min(block_start + query_block, kv_len)
                groups.append(_extend_group(row + block_start - start, block_start, block_end, slots, rslots,
                                            window, divisors))
        row += q_len
    if decode[0]:
        groups.append(_decode_group(*decode, window, divisors, device))
    if len(groups) == 1 and groups[0].num_seqs * groups[0].q_len == row:  # distinct rows of [0, row), ascending
        groups[0].covers_all = True
    out = batch.out_slots if recent is batch.kv_slots else torch.cat(out_slots)
    return V4Batch(batch.positions, out, batch.input_ids, groups,
                   {m: _windows(batch, recent, m, divisors[m]) for m in ratios})
