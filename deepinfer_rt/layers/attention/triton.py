"""Triton attention backend (chosen on CUDA).

Decode rows (one query per sequence) run the paged decode kernel (deepinfer_kernels.decode_attention) over a
page table; eager batches use a slot table (page size 1) built from the batch's slot lists, CUDA graphs
(deepinfer_rt.cuda_graph) hand in their own persistent page table through `DecodeMeta`. Prefill chunks run
torch SDPA per sequence: with no cached prefix it is the causal kernel (flash / memory-efficient), otherwise
the lower-right causal bias (memory-efficient kernel, no mask built). Steps built from the runner's device
page table (ForwardBatch.pages) decode through that table as it is. New K/V are stored by a scatter kernel that skips negative slots, so
graph padding rows write nothing.

FP8 KV (pool.is_fp8): the store kernel quantizes each (token, head) row as it writes it (elementwise.store_kv_fp8),
decode reads the float8 rows and their scales in the kernel, prefill chunks dequantize the rows they gather.
MLA's fused norm-rope-store kernel writes rows in the model dtype only, so it is off for such pools.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.utils.rnn import pad_sequence

from deepinfer_kernels.decode_attention import FP8_KV_DOTS, num_splits_for, paged_decode_attention
from deepinfer_kernels.dispatch import pdl_supported
from deepinfer_kernels.elementwise import store_kv, store_kv_fp8
from deepinfer_rt.env import get_env
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend, joined
from deepinfer_rt.layers.attention.torch_ref import causal_mask


def _to_query_heads(x: torch.Tensor, hq: int) -> torch.Tensor:
    """(Hkv, L, D) -> (Hq, L, D): the fused SDPA kernels take no GQA broadcast. One KV head (MLA) is
    expanded without a copy."""
    return x.expand(hq, -1, -1) if x.shape[0] == 1 else x.repeat_interleave(hq // x.shape[0], dim=0)


def _causal(q_len: int, kv_len: int, device: torch.device):
    """A chunk's causal mask over its prefix and itself (None without a prefix: SDPA's own causal form). On
    CUDA the lower-right causal bias keeps a chunk at a long offset in the fused kernels, with no (q, kv) mask
    materialised (an 8K chunk over a 32K prefix: 320 MB); elsewhere it would only be materialised."""
    if q_len == kv_len:
        return None
    return causal_lower_right(q_len, kv_len) if device.type == "cuda" else causal_mask(q_len, kv_len, device)


@dataclass
class DecodeMeta:
    page_table: torch.Tensor
    """(R, W) int32 page ids per table row."""
    table_rows: torch.Tensor
    """(B,) int32 table row of each decode sequence."""
    seq_lens: torch.Tensor
    """(B,) int32 KV length of each decode sequence (0 for padding rows)."""
    page_size: int
    num_splits: int


@dataclass
class TritonMeta:
    decode: DecodeMeta | None
    decode_rows: torch.Tensor | None
    """Token rows of the decode queries; None when every row is a decode query (no gather needed)."""
    extends: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    """(q_start, q_len, kv slots, causal mask or None when the chunk has no cached prefix)."""


class TritonBackend(AttentionBackend):
    name = "triton"
    is_rope_store_supported = True
    is_mla_standard_prefill_preferred = True

    def __init__(self, device: torch.device, is_kv_fp8: bool = False):
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.is_rope_store_supported = not is_kv_fp8
        self.kv_dot = get_env().fp8_kv_dot
        if self.kv_dot not in FP8_KV_DOTS:
            raise ValueError(f"DEEPINFER_FP8_KV_DOT={self.kv_dot!r}: not one of {FP8_KV_DOTS}")
        self.pdl = get_env().gpu_pdl and pdl_supported(device)
        """Decode attention as programmatic dependent launches (DEEPINFER_GPU_PDL)."""

    def decode_meta(self, page_table, table_rows, seq_lens, page_size, kv_heads, head_dim=0) -> DecodeMeta:
        splits = num_splits_for(int(table_rows.shape[0]), kv_heads, self.num_sms, head_dim)
        return DecodeMeta(page_table, table_rows, seq_lens, page_size, splits)

    def prepare(self, batch: ForwardBatch) -> None:
        dev = batch.input_ids.device
        rows, seqs, lens, extends = [], [], [], []
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
            if q_len == 1:
                rows.append(start)
                seqs.append(i)
                lens.append(kv_len)
            else:
                extends.append((start, q_len, batch.kv_slots[i], _causal(q_len, kv_len, dev)))
            start += q_len
        decode = None
        if rows:
            seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
            if batch.pages is not None:  # the runner's device page table: nothing of the context is built
                table_rows = batch.pages.rows if len(seqs) == batch.num_seqs else batch.pages.rows[
                    torch.tensor(seqs, device=dev)]
                decode = self.decode_meta(batch.pages.table, table_rows, seq_lens, batch.pages.page_size,
                                          *batch.pool.k[0].shape[1:])
            else:
                table = pad_sequence([batch.kv_slots[i] for i in seqs], batch_first=True).to(torch.int32)
                decode = self.decode_meta(table, torch.arange(len(rows), dtype=torch.int32, device=dev), seq_lens,
                                          1, *batch.pool.k[0].shape[1:])
        all_decode = len(rows) == batch.num_tokens
        batch.attn_meta = TritonMeta(decode, None if all_decode or not rows else torch.tensor(rows, device=dev),
                                     extends)

    def store_kv(self, batch: ForwardBatch, layer_id: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        pool = batch.pool
        if pool.is_fp8:
            store_kv_fp8(pool.k[layer_id], pool.k_scale[layer_id], batch.out_slots, k, pdl=self.pdl)
            if v is not None:
                store_kv_fp8(pool.v[layer_id], pool.v_scale[layer_id], batch.out_slots, v, pdl=self.pdl)
            return
        store_kv(pool.k[layer_id], batch.out_slots, k)
        if v is not None:
            store_kv(pool.v[layer_id], batch.out_slots, v)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
                q_tail: torch.Tensor | None = None) -> torch.Tensor:
        meta: TritonMeta = batch.attn_meta
        pool = batch.pool
        k_buf, v_buf = pool.k[layer_id], pool.v[layer_id]
        scales = dict(k_scale=pool.k_scale[layer_id], v_scale=pool.v_scale[layer_id],
                      kv_dot=self.kv_dot) if pool.is_fp8 else {}
        d = meta.decode
        if d is not None and meta.decode_rows is None:
            return paged_decode_attention(q, k_buf, v_buf, d.page_table, d.table_rows, d.seq_lens, d.page_size,
                                          scale, d.num_splits, q_tail=q_tail, pdl=self.pdl,
                                          **scales)
        q = joined(q, q_tail)
        out = q.new_empty(q.shape[0], q.shape[1], v_buf.shape[-1])
        if d is not None:
            out[meta.decode_rows] = paged_decode_attention(q[meta.decode_rows], k_buf, v_buf, d.page_table,
                                                           d.table_rows, d.seq_lens, d.page_size, scale,
                                                           d.num_splits, pdl=self.pdl, **scales)
        hq = q.shape[1]
        for q_start, q_len, slots, mask in meta.extends:
            qe = q[q_start : q_start + q_len].transpose(0, 1)  # (Hq, L, D)
            ke, ve = pool.rows(layer_id, slots)  # dequantized from an fp8 pool
            ke, ve = _to_query_heads(ke.transpose(0, 1), hq), _to_query_heads(ve.transpose(0, 1), hq)
            # 4-D: the fused SDPA kernels (flash, memory-efficient) take only batched inputs.
            oe = F.scaled_dot_product_attention(qe[None], ke[None], ve[None], attn_mask=mask, is_causal=mask is None,
                                                scale=scale)
            out[q_start : q_start + q_len] = oe[0].transpose(0, 1)
        return out
