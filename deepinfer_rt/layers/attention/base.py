"""Attention backend contract.

A backend computes causal attention of each sequence's new queries over all of its KV in the pool:
query j of sequence i (absolute position p = kv_lens[i] - q_lens[i] + j) attends to positions 0..p.
GQA is expressed by Hq being a multiple of the pool's KV heads; MLA (absorbed) by one KV head whose V is a
prefix of K's columns. Backends write the pool only in `store_kv` (called by ForwardBatch.attention) and never
make policy.

Adding a backend is one file: subclass, implement `prepare` and `forward`, register in `BACKENDS`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer_rt.forward_batch import ForwardBatch


class AttentionBackend:
    name = "base"
    is_rope_store_supported = False
    """Whether layers may rotate and store their new keys with one kernel writing batch.pool directly instead of
    `store_kv` (deepinfer_kernels.elementwise: mla_rope_store for MLA latents, gqa_rope_store for GQA K / V)."""
    is_mla_standard_prefill_preferred = False
    """Whether long MLA prefill chunks take the standard form by default (layers/mla_prefill.py): the backend's
    prefill runs flash attention at the model's own head dims."""

    def prepare(self, batch: "ForwardBatch") -> None:
        """Build per-batch metadata into batch.attn_meta (index tensors, masks); called once per step."""
        raise NotImplementedError

    def store_kv(self, batch: "ForwardBatch", layer_id: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Write the new tokens' k/v (T, Hkv, D) to the pool at batch.out_slots."""
        batch.pool.write(layer_id, batch.out_slots, k, v)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: "ForwardBatch",
                q_tail: torch.Tensor | None = None) -> torch.Tensor:
        """q (T, Hq, Dqk) -> (T, Hq, Dv), reading k/v of `layer_id` from batch.pool. q_tail: the query's last
        columns given apart (MLA's rope part), q then holding the others; a backend that cannot take them apart
        concatenates (`joined`)."""
        raise NotImplementedError


def joined(q: torch.Tensor, q_tail: torch.Tensor | None) -> torch.Tensor:
    return q if q_tail is None else torch.cat([q, q_tail], dim=-1)
