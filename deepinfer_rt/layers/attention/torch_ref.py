"""Reference attention in plain torch (CPU and any device).

Decode rows (one query per sequence) run as one padded batched SDPA over gathered KV; so do sequences with a
few new tokens (speculative verification: last token + drafts), padded to the longest; sequences with more
new tokens (prefill chunks) run one SDPA each with an explicit causal mask offset by their cached prefix.

Host work per layer is kept small, since on CPU the step is mostly such overhead at small batches: a batch of
decode rows only (every row one sequence, in order) attends without gathering its queries or scattering its
outputs; a sequence whose KV occupies consecutive slots (a lone stream, a prefill chunk) reads the pool through a
view instead of a gather; the padded decode gather writes into buffers allocated once per step.

A pool in fp8_e4m3 is read through its dequantizing gathers (KVPool.rows / span): the gathered rows come back in
the model dtype and attention runs on them as on any other (the reference form of FP8 KV).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend, joined


@dataclass
class _Extend:
    q_start: int
    q_len: int
    slots: torch.Tensor  # (kv_len,)
    mask: torch.Tensor | None  # (q_len, kv_len) bool, True = attend; None: no cached prefix, plain causal
    first_slot: int | None = None  # the slots are first_slot .. first_slot + kv_len - 1: the pool is read as a view


_SHORT_QUERY = 8
"""Sequences with 1 < q_len <= this many new tokens are batched together (one SDPA call per layer)."""


@dataclass
class _Short:
    rows: torch.Tensor  # (Bs, Qmax) token rows of each sequence's queries, padded with row 0
    valid: torch.Tensor  # (Bs, Qmax) bool, False on padding
    slots: torch.Tensor  # (Bs, Lmax) padded with slot 0
    mask: torch.Tensor  # (Bs, 1, Qmax, Lmax) bool: causal, offset by each cached prefix


@dataclass
class _Meta:
    decode_rows: torch.Tensor | None  # (Bd,) token rows of decode queries
    decode_slots: torch.Tensor | None  # (Bd, Lmax) padded with slot 0
    decode_mask: torch.Tensor | None  # (Bd, 1, 1, Lmax) bool; None for one sequence (nothing padded)
    extends: list[_Extend]
    short: _Short | None = None
    is_all_decode: bool = False  # every row is a decode row, row i of sequence i: no query gather, no scatter
    decode_first_slot: int | None = None  # one decode sequence on consecutive slots from here: read as a view
    decode_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # gather buffers (Bd * Lmax, Hkv, D), K and V
    decode_kv_heads: tuple[torch.Tensor, torch.Tensor] | None = None  # the same buffers as (Bd, Hkv, Lmax, D) views
    decode_flat: torch.Tensor | None = None  # decode_slots.view(-1)


def first_of_run(slots: torch.Tensor) -> int | None:
    """slots[0] when `slots` are consecutive ascending (s, s + 1, ...), else None."""
    n = slots.shape[0]
    if n == 0:
        return None
    first = int(slots[0])
    if n == 1 or (int(slots[-1]) - first == n - 1 and bool((slots[1:] - slots[:-1] == 1).all())):
        return first
    return None


def causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        device = batch.input_ids.device
        decode_rows, decode_slots, extends, short = [], [], [], []
        start = 0
        for q_len, kv_len, slots in zip(batch.q_lens, batch.kv_lens, batch.kv_slots):
            if q_len == 1:
                decode_rows.append(start)
                decode_slots.append(slots)
            elif q_len <= _SHORT_QUERY:
                short.append((start, q_len, slots))
            else:
                # Without a cached prefix SDPA's own causal form: bit-identical to the mask, and it skips the
                # blocks above the diagonal (1.6x on a 1K-token CPU prefill's attention)
                mask = None if q_len == kv_len else causal_mask(q_len, kv_len, device)
                extends.append(_Extend(start, q_len, slots, mask, first_of_run(slots)))
            start += q_len
        meta = _Meta(None, None, None, extends, _short_meta(short, device) if short else None)
        meta.is_all_decode = len(decode_rows) == len(batch.q_lens)
        if meta.is_all_decode and len(decode_slots) == 1:
            meta.decode_first_slot = first_of_run(decode_slots[0])
            if meta.decode_first_slot is not None:
                meta.decode_rows = torch.zeros(1, dtype=torch.long, device=device)
                batch.attn_meta = meta
                return
        if decode_rows:
            lens = torch.tensor([len(s) for s in decode_slots], device=device)
            max_len = int(lens.max())
            padded = torch.zeros(len(decode_slots), max_len, dtype=torch.long, device=device)
            for i, s in enumerate(decode_slots):
                padded[i, : len(s)] = s
            meta.decode_rows = torch.tensor(decode_rows, device=device)
            meta.decode_slots, meta.decode_flat = padded, padded.view(-1)
            if len(decode_slots) > 1:  # one sequence has no padding: SDPA without a mask (no per-layer mask ops)
                meta.decode_mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
            k0, v0 = batch.pool.k[0], batch.pool.v[0]
            if not batch.pool.is_fp8 and all(k.shape == k0.shape for k in batch.pool.k) and all(v.shape == v0.shape for v in batch.pool.v):
                # One pair for all layers: each layer's gather is read by its SDPA before the next layer's.
                meta.decode_kv = (k0.new_empty(padded.numel(), *k0.shape[1:]),
                                  v0.new_empty(padded.numel(), *v0.shape[1:]))
                # Views made once: every layer's gather writes the same buffers
                meta.decode_kv_heads = tuple(b.view(len(decode_slots), max_len, *b.shape[1:]).transpose(1, 2)
                                             for b in meta.decode_kv)
        batch.attn_meta = meta

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
                q_tail: torch.Tensor | None = None) -> torch.Tensor:
        q = joined(q, q_tail)
        meta: _Meta = batch.attn_meta
        pool = batch.pool
        k_buf, v_buf = pool.k[layer_id], pool.v[layer_id]
        gqa = q.shape[1] != k_buf.shape[1]
        if meta.decode_first_slot is not None:  # one stream on consecutive slots: the pool rows as they are
            if pool.is_fp8:
                kd, vd = pool.span(layer_id, meta.decode_first_slot, batch.kv_lens[0])
                kd, vd = kd.transpose(0, 1)[None], vd.transpose(0, 1)[None]  # (1, Hkv, L, D)
            else:  # the same (1, Hkv, L, D) views in one op each
                kd, vd = _heads_view(k_buf, meta.decode_first_slot, batch.kv_lens[0]), \
                    _heads_view(v_buf, meta.decode_first_slot, batch.kv_lens[0])
            od = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, scale=scale, enable_gqa=gqa)
            return od.squeeze(2)
        if meta.decode_rows is not None:
            qd = (q if meta.is_all_decode else q[meta.decode_rows]).unsqueeze(2)  # (Bd, Hq, 1, D)
            flat = meta.decode_flat  # index_select is much faster than advanced indexing on CPU
            if meta.decode_kv_heads is not None:
                torch.index_select(k_buf, 0, flat, out=meta.decode_kv[0])
                torch.index_select(v_buf, 0, flat, out=meta.decode_kv[1])
                kd, vd = meta.decode_kv_heads
            else:
                bd, max_len = meta.decode_slots.shape
                kd, vd = (pool.rows(layer_id, flat) if pool.is_fp8
                          else (torch.index_select(k_buf, 0, flat), torch.index_select(v_buf, 0, flat)))
                kd = kd.view(bd, max_len, *k_buf.shape[1:]).transpose(1, 2)
                vd = vd.view(bd, max_len, *v_buf.shape[1:]).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                                enable_gqa=gqa)
            if meta.is_all_decode:
                return od.squeeze(2)  # (Bd, Hq, Dv)
        out = q.new_empty(q.shape[0], q.shape[1], v_buf.shape[-1])
        if meta.decode_rows is not None:
            out.index_copy_(0, meta.decode_rows, od.squeeze(2))
        if meta.short is not None:
            s = meta.short
            bs, q_max = s.rows.shape
            qs = q[s.rows.view(-1)].view(bs, q_max, *q.shape[1:]).transpose(1, 2)  # (Bs, Hq, Qmax, D)
            flat = s.slots.view(-1)
            ks, vs = pool.rows(layer_id, flat)
            ks = ks.view(bs, s.slots.shape[1], *k_buf.shape[1:]).transpose(1, 2)
            vs = vs.view(bs, s.slots.shape[1], *v_buf.shape[1:]).transpose(1, 2)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=scale, enable_gqa=gqa)
            out[s.rows[s.valid]] = os_.transpose(1, 2)[s.valid]
        for e in meta.extends:
            qe = q[e.q_start : e.q_start + e.q_len].transpose(0, 1)  # (Hq, q_len, D)
            ke, ve = (pool.rows(layer_id, e.slots) if e.first_slot is None
                      else pool.span(layer_id, e.first_slot, len(e.slots)))
            ke, ve = ke.transpose(0, 1), ve.transpose(0, 1)  # (Hkv, kv_len, D)
            # 4-D operands: unbatched (3-D) ones send CPU SDPA to its math path, 5-9x slower at 1K tokens
            oe = F.scaled_dot_product_attention(qe[None], ke[None], ve[None], attn_mask=e.mask, scale=scale,
                                                is_causal=e.mask is None, enable_gqa=gqa)
            out[e.q_start : e.q_start + e.q_len] = oe[0].transpose(0, 1)
        return out


def _heads_view(buf: torch.Tensor, first: int, n: int) -> torch.Tensor:
    """Rows first .. first + n - 1 of a pool buffer (S, H, D) as a (1, H, n, D) view: narrow, transpose and
    unsqueeze in one as_strided."""
    row, head, col = buf.stride()
    return buf.as_strided((1, buf.shape[1], n, buf.shape[2]), (row * n, head, row, col),
                          buf.storage_offset() + first * row)


def _short_meta(short: list[tuple[int, int, torch.Tensor]], device: torch.device) -> _Short:
    q_max, l_max = max(q for _, q, _ in short), max(len(s) for _, _, s in short)
    rows = torch.zeros(len(short), q_max, dtype=torch.long, device=device)
    slots = torch.zeros(len(short), l_max, dtype=torch.long, device=device)
    kv_lens, q_lens = [], []
    for b, (start, q_len, s) in enumerate(short):
        rows[b, :q_len] = torch.arange(start, start + q_len, device=device)
        slots[b, : len(s)] = s
        kv_lens.append(len(s))
        q_lens.append(q_len)
    kv = torch.tensor(kv_lens, device=device)[:, None, None]
    q_pos = kv - torch.tensor(q_lens, device=device)[:, None, None] + torch.arange(q_max, device=device)[None, :, None]
    mask = torch.arange(l_max, device=device)[None, None, :] <= q_pos  # padded query rows see a valid prefix
    valid = torch.arange(q_max, device=device)[None, :] < torch.tensor(q_lens, device=device)[:, None]
    return _Short(rows, valid, slots, mask[:, None])


BACKENDS = {"torch": TorchRefBackend}
