"""Batch-invariant attention on CUDA: every query row, prefill or decode, is one row of the fixed-split decode
kernel (deepinfer_kernels.decode_attention.paged_decode_attention_fixed).

Query j of sequence i (absolute position p) becomes an independent decode row: its sequence's KV as the table
row and seq_len = p + 1 (causal). The kernel cuts each row's keys at fixed absolute positions and merges the
pieces in ascending order, with tiles and warps fixed by the head dims, so a token's result is bitwise the same
in prefill, in a chunk of any size, in decode (eager or CUDA graph), from prefix-cache keys or freshly stored
ones, and whatever else shares the batch. FP8 KV keeps this: rows are quantized one by one when stored
and dequantized per key in the kernel, so no value depends on the batch. Each query row reads its keys on its own: prefill reads a chunk's
KV once per query instead of once per chunk, decode reads it once, as the default kernel does.

The KV store, the metadata types and the CUDA-graph hook (`decode_meta`, called by deepinfer_rt.cuda_graph) are
the Triton backend's; only the split rule differs. Nothing here depends on the device, so Triton's interpreter
runs this backend on CPU in the tests.
"""
from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from deepinfer_kernels.decode_attention import fixed_num_splits, paged_decode_attention_fixed
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend
from deepinfer_rt.layers.attention.triton import DecodeMeta, TritonBackend, TritonMeta


class TritonInvariantBackend(AttentionBackend):
    name = "triton_invariant"
    store_kv = TritonBackend.store_kv  # the scatter kernel, which skips graph padding rows (slot -1)

    def decode_meta(self, page_table, table_rows, seq_lens, page_size, kv_heads, head_dim=0) -> DecodeMeta:
        """Split count from the table's capacity alone (a graph's: its longest context), never the batch."""
        return DecodeMeta(page_table, table_rows, seq_lens, page_size,
                          fixed_num_splits(page_table.shape[1] * page_size))

    def prepare(self, batch: ForwardBatch) -> None:
        dev = batch.input_ids.device
        rows, lens = [], []
        for i, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
            rows.extend([i] * q_len)
            lens.extend(range(kv_len - q_len + 1, kv_len + 1))  # query at position p sees p + 1 keys
        rows_lens = torch.tensor([rows, lens], dtype=torch.int32, device=dev)
        if batch.pages is not None:  # the runner's device page table: each query row reads its sequence's row
            table, page_size = batch.pages.table, batch.pages.page_size
            table_rows = batch.pages.rows[rows_lens[0]]
        else:
            table = pad_sequence(list(batch.kv_slots), batch_first=True).to(torch.int32)  # page size 1
            table_rows, page_size = rows_lens[0], 1
        batch.attn_meta = TritonMeta(self.decode_meta(table, table_rows, rows_lens[1], page_size,
                                                      batch.pool.k[0].shape[1]), None)

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
                q_tail: torch.Tensor | None = None) -> torch.Tensor:
        d: DecodeMeta = batch.attn_meta.decode
        pool = batch.pool
        scales = dict(k_scale=pool.k_scale[layer_id], v_scale=pool.v_scale[layer_id]) if pool.is_fp8 else {}
        return paged_decode_attention_fixed(q, pool.k[layer_id], pool.v[layer_id], d.page_table,
                                            d.table_rows, d.seq_lens, d.page_size, scale, d.num_splits,
                                            q_tail=q_tail, **scales)
