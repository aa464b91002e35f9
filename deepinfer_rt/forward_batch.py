"""ForwardBatch: the tensors one model step reads, built by the ModelRunner from a ScheduledBatch.

Tokens of all sequences are flattened with no padding. Sequence i contributes q_lens[i] new tokens whose
positions are kv_lens[i] - q_lens[i] ... kv_lens[i] - 1; its KV for positions 0 .. kv_lens[i] - 1 lives in the
pool at kv_slots[i] (the new tokens' KV is written there by the attention layer before it attends).

Steps built by the runner carry `pages`, each sequence's row of the persistent device page table
(deepinfer_rt.cache.page_table): the host then builds nothing of a sequence's context, only its new tokens'
rows. Their `kv_slots` are derived from the table on the device when a layer first asks (`TableSlots`);
backends that read the page table directly (Triton's decode) never derive them.

    input_ids   (T,)   positions (T,)   out_slots (T,)    T = sum(q_lens)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.cache.page_table import DevicePages


class TableSlots(Sequence):
    """kv_slots of a batch whose sequences have page table rows: sequence i's slots are derived on the device
    on first access (a view of its row at page size 1) and kept."""

    def __init__(self, pages: "DevicePages", rows: list[int], kv_lens: list[int]):
        self._pages, self._rows, self._kv_lens = pages, rows, kv_lens
        self._slots: list[torch.Tensor | None] = [None] * len(rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s = self._slots[i]
        if s is None:
            s = self._slots[i] = self._pages.slots(self._rows[i], self._kv_lens[i])
        return s


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    q_lens: list[int]
    kv_lens: list[int]
    kv_slots: "list[torch.Tensor] | TableSlots"
    pool: "KVPool"
    backend: Any
    """The step's attention backend (layers/attention/base.py's contract, which takes ForwardBatch in turn)."""
    pages: "DevicePages | None" = None
    """Each sequence's page table row, when the runner built the step from its device page table."""
    attn_meta: Any = None
    """Backend-specific metadata, built once per batch by `backend.prepare(batch)` and shared by all layers."""
    mla_plan: Any = None
    """How MLA layers split this batch between the absorbed and standard forms (layers.mla_prefill), built by
    the model's `prepare_batch` (models/deepseek_v3.py) and shared by its MLA layers."""
    model_meta: Any = None
    """Other per-step metadata a model builds once in `prepare_batch` for all its layers (DeepSeek-V4's
    V4Batch)."""

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layer_id: int,
                  scale: float) -> torch.Tensor:
        """Store the new tokens' k/v in the pool, then attend. q (T, Hq, Dqk) -> (T, Hq, Dv)."""
        self.backend.store_kv(self, layer_id, k, v)
        return self.backend.forward(q, layer_id, scale, self)


def resolve_placeholders(ids: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
    """Token ids with placeholders (-1 - k) replaced by future[k], on the device (overlap scheduling: a row whose
    input is a token the previous step sampled and the host has not seen yet)."""
    index = (-1 - ids).clamp_(0, future.shape[0] - 1)
    return torch.where(ids < 0, future[index], ids)
