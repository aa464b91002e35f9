"""DeepSeek-V4 decode steps of fixed shape, for CUDA graphs: the step's V4Batch computed on the device from static
per-row inputs, with shapes set by (batch size, pool), never by the contexts, and no value read back to the host.

A captured graph records the model's forward only, so the indices cannot be built once in prepare_batch (as eager
steps do, batch.py): `StaticDecode` holds the static inputs and the forward calls its `for_step()` first, inside
the capture. Per row b (position p, page table row, kv length p + 1; length 0 = a padding row):

    sliding keys    W slots: positions max(0, p-W+1) .. that + W-1, masked past p (the eager step's order: its
                    valid keys first, then padding)
    entries         E_m = (row width in tokens) // m slots per ratio m: entry j ends at position (j+1)m - 1,
                    visible while j < (p+1) // m (a masked fixed-width row: the indexer's top-k is taken over it)
    windows         one per row and ratio: completed when (p+1) % m == 0; the compressor pools all B of them and
                    writes only those rows' entries, the others into the pool's padding row

Recent slots go through the pool's device indirection (recent_of_t) of the main page in the page table; the host
part of the pool's bookkeeping (recent pages attached, released, pinned) runs before the replay
(V4Pool.prepare_decode, from the host's page lists). Masked reads use slot 0, as the eager step pads; writes of
padding rows and of rows completing no window go to the padding rows (V4Pool.pad_recent_slot / pad_entry_row).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_rt.models.deepseek_v4.batch import AttnGroup, V4Batch, Windows
from deepinfer_rt.models.deepseek_v4.cache import V4Pool


@dataclass
class StaticDecode:
    """A fixed-size decode step's inputs; `for_step()` computes its V4Batch with device ops only."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    """(B,) int64."""
    seq_lens: torch.Tensor
    """(B,) kv length, 0 for a padding row."""
    table: torch.Tensor
    """(R, width) int32 page table."""
    rows: torch.Tensor
    """(B,) table row of each row of the batch."""
    pool: V4Pool
    window: int
    ratios: tuple[int, ...]

    def main_slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Main slots of positions pos (B, K) of each row (0 <= pos <= its position)."""
        ps = self.pool.page_size
        return self.table[self.rows.long()[:, None], pos // ps].long() * ps + pos % ps

    def recent_slots(self, pos: torch.Tensor, ok: torch.Tensor, fill: int) -> torch.Tensor:
        """Recent slots of positions pos (B, K) where ok and held, else `fill`."""
        ps = self.pool.page_size
        recent = self.pool.recent_of_t[self.table[self.rows.long()[:, None], pos // ps].long()]
        return torch.where(ok & (recent >= 0), recent * ps + pos % ps, fill)

    def for_step(self) -> V4Batch:
        """The step's V4Batch: on CUDA from deepinfer_kernels.v4_static_decode (five launches for V4's two ratios),
        elsewhere from torch ops (the same values)."""
        return self.kernel_step() if self.positions.is_cuda else self.torch_step()

    def kernel_step(self) -> V4Batch:
        from deepinfer_kernels import v4_static_decode as k

        pool, p = self.pool, self.positions
        args = (p, self.seq_lens, self.rows, self.table)
        ps, width = pool.page_size, self.table.shape[1] * pool.page_size
        swa, swa_ok, out = k.sliding(*args, pool.recent_of_t, ps, self.window, pool.pad_recent_slot)
        entry_slots, entry_mask, windows = {}, {}, {}
        for m in self.ratios:
            div = pool.entry_divisor(m)
            entry_slots[m], visible = k.entries(*args, ps, m, div, width // m)
            entry_mask[m] = visible[:, None, :]
            windows[m] = Windows(*k.windows(*args, pool.recent_of_t, ps, m, div, pool.pad_entry_row(m)))
        group = AttnGroup(torch.arange(p.shape[0], device=p.device), int(p.shape[0]), 1, swa, swa_ok[:, None, :],
                          entry_slots, entry_mask, covers_all=True)
        return V4Batch(p, out, self.input_ids, [group], windows)

    def torch_step(self) -> V4Batch:
        pool, p, valid = self.pool, self.positions, self.seq_lens > 0
        last = p[:, None]
        width = self.table.shape[1] * pool.page_size
        k = (p - self.window + 1).clamp(min=0)[:, None] + torch.arange(self.window, device=p.device)
        swa_ok = (k <= last) & valid[:, None]
        k = torch.minimum(k, last)
        out = self.recent_slots(last, valid[:, None], pool.pad_recent_slot)[:, 0]
        entry_slots, entry_mask, windows = {}, {}, {}
        for m in self.ratios:
            div = pool.entry_divisor(m)
            j = torch.arange(width // m, device=p.device)
            visible = (j < (last + 1) // m) & valid[:, None]  # (B, E)
            ends = torch.minimum((j + 1) * m - 1, last)
            entry_slots[m] = torch.where(visible, self.main_slots(ends) // div, 0)
            entry_mask[m] = visible[:, None, :]
            windows[m] = self._windows(m, div, valid)
        group = AttnGroup(torch.arange(p.shape[0], device=p.device), int(p.shape[0]), 1,
                          self.recent_slots(k, swa_ok, 0), swa_ok[:, None, :], entry_slots, entry_mask,
                          covers_all=True)
        return V4Batch(p, out, self.input_ids, [group], windows)

    def _windows(self, m: int, div: int, valid: torch.Tensor) -> Windows:
        p = self.positions
        last = p[:, None]
        done = valid & ((p + 1) % m == 0)
        first = ((p + 1) // m - 1).clamp(min=0) * m  # (B,) the window ending at p, when it does
        pos = first[:, None] + torch.arange(m, device=p.device)
        ok = torch.ones_like(pos, dtype=torch.bool)
        cur = self.recent_slots(torch.minimum(pos, last), ok, 0)
        prev = self.recent_slots(torch.minimum((pos - m).clamp(min=0), last), ok, 0)
        end = torch.where(done, self.main_slots(last)[:, 0] // div, self.pool.pad_entry_row(m))
        return Windows(cur, prev, first > 0, first, end)
