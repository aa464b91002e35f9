"""Reference attention in plain torch (CPU and any device).

Decode rows (one query per sequence) run as one padded batched SDPA over gathered KV; sequences with several
new tokens (prefill chunks) run one SDPA each with an explicit causal mask offset by their cached prefix.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend


@dataclass
class _Extend:
    q_start: int
    q_len: int
    slots: torch.Tensor  # (kv_len,)
    mask: torch.Tensor  # (q_len, kv_len) bool, True = attend


@dataclass
class _Meta:
    decode_rows: torch.Tensor | None  # (Bd,) token rows of decode queries
    decode_slots: torch.Tensor | None  # (Bd, Lmax) padded with slot 0
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Lmax) bool
    extends: list[_Extend]


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        decode_rows, decode_slots, extends = [], [], []
        start = 0
        for q_len, kv_len, slots in zip(batch.q_lens, batch.kv_lens, batch.kv_slots):
            if q_len == 1:
                decode_rows.append(start)
                decode_slots.append(slots)
            else:
                extends.append(_Extend(start, q_len, slots, causal_mask(q_len, kv_len, device)))
            start += q_len
        meta = _Meta(None, None, None, extends)
        if decode_rows:
            lens = torch.tensor([len(s) for s in decode_slots], device=device)
            max_len = int(lens.max())
            padded = torch.zeros(len(decode_slots), max_len, dtype=torch.long, device=device)
            for i, s in enumerate(decode_slots):
                padded[i, : len(s)] = s
            meta.decode_rows = torch.tensor(decode_rows, device=device)
            meta.decode_slots = padded
            meta.decode_mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
        batch.attn_meta = meta

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch) -> torch.Tensor:
        meta: _Meta = batch.attn_meta
        k_buf, v_buf = batch.pool.k[layer_id], batch.pool.v[layer_id]
        out = q.new_empty(q.shape[0], q.shape[1], v_buf.shape[-1])
        gqa = q.shape[1] != k_buf.shape[1]
        if meta.decode_rows is not None:
            qd = q[meta.decode_rows].unsqueeze(2)  # (Bd, Hq, 1, D)
            bd, max_len = meta.decode_slots.shape
            flat = meta.decode_slots.view(-1)  # index_select is much faster than advanced indexing on CPU
            kd = k_buf.index_select(0, flat).view(bd, max_len, *k_buf.shape[1:]).transpose(1, 2)  # (Bd, Hkv, L, D)
            vd = v_buf.index_select(0, flat).view(bd, max_len, *v_buf.shape[1:]).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                                enable_gqa=gqa)
            out[meta.decode_rows] = od.squeeze(2)
        for e in meta.extends:
            qe = q[e.q_start : e.q_start + e.q_len].transpose(0, 1)  # (Hq, q_len, D)
            ke = k_buf.index_select(0, e.slots).transpose(0, 1)  # (Hkv, kv_len, D)
            ve = v_buf.index_select(0, e.slots).transpose(0, 1)
            oe = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=e.mask, scale=scale, enable_gqa=gqa)
            out[e.q_start : e.q_start + e.q_len] = oe.transpose(0, 1)
        return out


BACKENDS = {"torch": TorchRefBackend}
