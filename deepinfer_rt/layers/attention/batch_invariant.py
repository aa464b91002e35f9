"""Batch-invariant attention: each query's reduction over its keys has split points at fixed absolute positions.
(The CPU form; CUDA runs the same idea in Triton kernels, deepinfer_rt.layers.attention.triton_invariant.)

Work is cut on a grid of absolute positions, the same for every batch, chunking and cache state:

    query tiles   positions [t*QUERY_TILE, (t+1)*QUERY_TILE) of one sequence (absent queries are zero rows)
    key blocks    positions [b*KEY_BLOCK, (b+1)*KEY_BLOCK)  (keys past the sequence's KV are zeroed, masked)

One work item is (tile, block) for every block at or before the tile's last query. Per item, a fixed-shape
GEMM gives the scores, the block-local max m, sum l and unnormalised output o; the items of a tile are then
merged in ascending block order (online softmax). A block a query cannot see has m = -inf, l = 0, o = 0, and
merging it is an exact identity, so a query's result is the same whether its tile holds other queries or not
(chunked prefill, prefill vs decode, prefix-cache hit vs miss, recompute after retraction).

Keys past a sequence's KV read its last key's slot (finite data) and are masked to -inf in the scores, so their
p is exactly 0 and neither keys nor values need zeroing. The item list is padded with empty items (no query,
nothing visible) to a multiple of GEMM_BATCH, so the batched GEMMs need no padding copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend

QUERY_TILE = 4
KEY_BLOCK = 64
GEMM_BATCH = 8
"""Matrices per batched GEMM call: every call has the same shape, so the BLAS takes the same path each time.
Small, so a decode step (one item per sequence and KV head) is not padded far."""


@dataclass
class _Meta:
    num_tiles: int
    item_rows: torch.Tensor  # (items * QUERY_TILE,) token row of each item query; T (a zero row) if absent
    key_slots: torch.Tensor  # (items * KEY_BLOCK,) pool slot of each key (the last key's where past the KV)
    hidden: torch.Tensor  # (items, QUERY_TILE, KEY_BLOCK) bool, True = the query does not see the key
    by_block: list[tuple[torch.Tensor, torch.Tensor]]  # block b -> (tiles, items) that have it; b = 0: all tiles
    out_rows: torch.Tensor  # (T,) row of each token in the flattened (tiles * QUERY_TILE) output


def fixed_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (N, M, K) @ b (N, K, P) as calls of the one shape (GEMM_BATCH, M, K) @ (GEMM_BATCH, K, P)."""
    n = a.shape[0]
    padded_n = -(-n // GEMM_BATCH) * GEMM_BATCH
    if padded_n == n:
        a_pad, b_pad = a, b
    else:
        a_pad = a.new_zeros(padded_n, *a.shape[1:])
        b_pad = b.new_zeros(padded_n, *b.shape[1:])
        a_pad[:n], b_pad[:n] = a, b
    out = a.new_empty(padded_n, a.shape[1], b.shape[2])
    for i in range(0, padded_n, GEMM_BATCH):
        torch.bmm(a_pad[i : i + GEMM_BATCH], b_pad[i : i + GEMM_BATCH], out=out[i : i + GEMM_BATCH])
    return out[:n]


def _plan(q_lens: list[int], kv_lens: list[int], kv_slots: list[torch.Tensor]) -> _Meta:
    """The work items of a batch (on CPU; moved to the device by `prepare`)."""
    tile_rows, item_tile, item_block, key_slots, q_pos, out_rows = [], [], [], [], [], []
    total = sum(q_lens)
    row = num_tiles = 0
    offsets, key_offsets = torch.arange(QUERY_TILE), torch.arange(KEY_BLOCK)
    for q_len, kv_len, slots in zip(q_lens, kv_lens, kv_slots):
        first, slots = kv_len - q_len, slots.cpu()
        t0 = first // QUERY_TILE
        pos = (t0 + torch.arange((kv_len - 1) // QUERY_TILE + 1 - t0))[:, None] * QUERY_TILE + offsets  # (nt, QT)
        present = (pos >= first) & (pos < kv_len)
        tile_rows.append(torch.where(present, row + pos - first, total))
        out_rows.append((num_tiles * QUERY_TILE + torch.arange(pos.numel())).view_as(pos)[present])
        num_blocks = pos[:, -1].clamp(max=kv_len - 1) // KEY_BLOCK + 1  # (nt,) blocks up to the last query
        local_tile = torch.repeat_interleave(torch.arange(len(pos)), num_blocks)
        block = torch.arange(len(local_tile)) - torch.repeat_interleave(num_blocks.cumsum(0) - num_blocks, num_blocks)
        kp = block[:, None] * KEY_BLOCK + key_offsets  # (items, KB) absolute key positions
        key_slots.append(slots[kp.clamp(max=kv_len - 1)])
        q_pos.append(torch.where(present, pos, -1)[local_tile])
        item_tile.append(local_tile + num_tiles)
        item_block.append(block)
        row += q_len
        num_tiles += len(pos)
    item_tile_t, item_block_t, q_pos_t = torch.cat(item_tile), torch.cat(item_block), torch.cat(q_pos)
    key_slots_t = torch.cat(key_slots)
    by_block = []
    for b in range(int(item_block_t.max()) + 1):
        items = (item_block_t == b).nonzero().squeeze(1)
        by_block.append((item_tile_t[items], items))
    pad = -len(item_tile_t) % GEMM_BATCH  # empty items: zero queries, every key masked, never merged
    item_rows = torch.cat([torch.cat(tile_rows)[item_tile_t], torch.full((pad, QUERY_TILE), total)])
    key_slots_t = torch.cat([key_slots_t, key_slots_t[:1].expand(pad, KEY_BLOCK)])
    q_pos_t = torch.cat([q_pos_t, torch.full((pad, QUERY_TILE), -1)])
    kp = torch.cat([item_block_t, item_block_t.new_zeros(pad)])[:, None] * KEY_BLOCK + key_offsets
    return _Meta(num_tiles=num_tiles, item_rows=item_rows.view(-1), key_slots=key_slots_t.view(-1),
                 hidden=kp[:, None, :] > q_pos_t[:, :, None], by_block=by_block, out_rows=torch.cat(out_rows))


class BatchInvariantBackend(AttentionBackend):
    name = "batch_invariant"

    def prepare(self, batch: ForwardBatch) -> None:
        meta = _plan(batch.q_lens, batch.kv_lens, batch.kv_slots)
        dev = batch.input_ids.device
        batch.attn_meta = _Meta(
            meta.num_tiles, *(getattr(meta, f).to(dev) for f in ("item_rows", "key_slots", "hidden")),
            by_block=[(tiles.to(dev), items.to(dev)) for tiles, items in meta.by_block],
            out_rows=meta.out_rows.to(dev))

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch) -> torch.Tensor:
        meta: _Meta = batch.attn_meta
        k_buf, v_buf = batch.pool.k[layer_id], batch.pool.v[layer_id]
        num_kv, head_dim, v_dim = k_buf.shape[1], k_buf.shape[2], v_buf.shape[2]
        num_items, (t, num_heads, _) = len(meta.hidden), q.shape
        group = num_heads // num_kv
        # Queries of each item: (items * Hkv, QT * G, D); keys (items * Hkv, D, KB); values (items * Hkv, KB, Dv).
        qz = torch.cat([q, q.new_zeros(1, num_heads, head_dim)])
        qi = qz.index_select(0, meta.item_rows).view(num_items, QUERY_TILE, num_kv, group, head_dim)
        qi = qi.permute(0, 2, 1, 3, 4).reshape(num_items * num_kv, QUERY_TILE * group, head_dim)
        ki = k_buf.index_select(0, meta.key_slots).view(num_items, KEY_BLOCK, num_kv, head_dim).permute(0, 2, 3, 1)
        vi = v_buf.index_select(0, meta.key_slots).view(num_items, KEY_BLOCK, num_kv, v_dim).transpose(1, 2)
        scores = fixed_bmm(qi, ki.reshape(num_items * num_kv, head_dim, KEY_BLOCK)) * scale
        scores = scores.view(num_items, num_kv, QUERY_TILE, group, KEY_BLOCK)
        scores = scores.masked_fill(meta.hidden[:, None, :, None, :], float("-inf"))
        m = scores.amax(dim=-1)  # (items, Hkv, QT, G); -inf where a query sees no key of the block
        p = torch.exp(scores - _finite(m)[..., None])
        l = p.sum(dim=-1)
        o = fixed_bmm(p.view(num_items * num_kv, QUERY_TILE * group, KEY_BLOCK),
                      vi.reshape(num_items * num_kv, KEY_BLOCK, v_dim))
        o = o.view(num_items, num_kv, QUERY_TILE, group, v_dim)
        out = _merge_blocks(meta, m, l, o)  # (tiles, Hkv, QT, G, Dv)
        out = out.permute(0, 2, 1, 3, 4).reshape(-1, num_heads, v_dim)
        return out[meta.out_rows]


def _finite(m: torch.Tensor) -> torch.Tensor:
    """m with -inf raised to the lowest finite value: x - m stays -inf for x = -inf, and exp of it 0."""
    return m.clamp(min=torch.finfo(m.dtype).min)


def _merge_blocks(meta: _Meta, m: torch.Tensor, l: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Online softmax over each tile's blocks in ascending absolute order; returns sum_j p_j v_j / sum_j p_j.
    Every tile has block 0, and merging it into the empty state is exact, so the state starts as block 0."""
    shape = (meta.num_tiles, *m.shape[1:])
    tiles, items = meta.by_block[0]
    acc_m = m.new_empty(shape).index_copy_(0, tiles, m[items])
    acc_l = l.new_empty(shape).index_copy_(0, tiles, l[items])
    acc_o = o.new_empty(*shape, o.shape[-1]).index_copy_(0, tiles, o[items])
    for tiles, items in meta.by_block[1:]:
        m_old, m_blk = acc_m[tiles], m[items]
        m_new = torch.maximum(m_old, m_blk)
        safe = _finite(m_new)
        a, c = torch.exp(m_old - safe), torch.exp(m_blk - safe)
        acc_m[tiles] = m_new
        acc_l[tiles] = acc_l[tiles] * a + l[items] * c
        acc_o[tiles] = acc_o[tiles] * a[..., None] + o[items] * c[..., None]
    return acc_o / acc_l[..., None]
