"""Batch-invariant attention: each query's reduction over its keys has split points at fixed absolute positions.
(The CPU form; CUDA runs the same idea in Triton kernels, deepinfer_rt.layers.attention.triton_invariant.)

Work is cut on a grid of absolute positions, the same for every batch, chunking and cache state:

    query tiles   positions [t*QUERY_TILE, (t+1)*QUERY_TILE) of one sequence (absent queries are masked)
    key blocks    positions [b*KEY_BLOCK, (b+1)*KEY_BLOCK)  (keys past the sequence's KV are zeroed, masked)

One work item is (tile, block) for every block at or before the tile's last query. Per item, a fixed-shape
GEMM gives the scores, the block-local max m, sum l and unnormalised output o. The items of a tile are merged
in a fixed number of ops whatever the context length: M = max of the tile's m (exact in any order), each item
scaled by exp(m - M) (elementwise), then the scaled l and o summed by `index_add_` along a middle dimension,
which on CPU adds the items one after another in list order, i.e. ascending block order. A block a query cannot
see has m = -inf, hence l = o = 0 after scaling, and adding it is an exact identity; the sums start from -0.0,
the exact identity of addition, so a tile of one item gives o / l bit for bit. A query's result is therefore
the same whether its tile holds other queries or not (chunked prefill, prefill vs decode, prefix-cache hit vs
miss, recompute after retraction).

Queries, keys, values, scores and outputs are head-major, (kv head, item, ...), gathered so from the pool, and
each GEMM is one batched call over every (kv head, item) pair. Absent queries of a tile read row 0 and
keys past a sequence's KV read its last key's slot (finite data); both are masked to -inf in the scores, so
their p is exactly 0 and no operand needs zeroing. The item list is padded with empty items (nothing visible,
merged into a spare tile that no output reads) to a multiple of GEMM_BATCH, so the GEMMs need no padding copies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.attention.base import AttentionBackend, joined

QUERY_TILE = 4
KEY_BLOCK = 64
EXP_FLOOR = -80.0
"""Lowest softmax exponent (score minus max) taken as it is: exp(-80) ~ 2e-35 is negligible beside the max's 1."""
GEMM_BATCH = 8
"""Matrices per batched GEMM call: every call has the same shape, so the BLAS takes the same path each time.
Small, so a decode step (one item per sequence and KV head) is not padded far."""


@dataclass
class _Meta:
    num_tiles: int
    item_rows: torch.Tensor  # (items * QUERY_TILE,) token row of each item query; 0 (masked) if absent
    key_slots: torch.Tensor  # (items * KEY_BLOCK,) pool slot of each key (the last key's where past the KV)
    key_bias: torch.Tensor  # (items, QUERY_TILE, KEY_BLOCK) 0 where the query sees the key, -inf where not
    key_weight: torch.Tensor  # (items, QUERY_TILE, KEY_BLOCK) 1 where the query sees the key, 0 where not
    item_tile: torch.Tensor  # (items,) tile of each item, ascending blocks within a tile; num_tiles for padding
    item_block: torch.Tensor  # (items,) key block of each item (0 for padding)
    one_block: bool  # every tile has one item (its block 0), in tile order: the merge is o / l as it stands
    out_rows: torch.Tensor  # (T,) row of each token in the flattened (tiles * QUERY_TILE) output


def fixed_bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a (N, M, K) @ b (N, K, P) as calls of the one shape (GEMM_BATCH, M, K) @ (GEMM_BATCH, K, P)."""
    n = a.shape[0]
    padded_n = -(-n // GEMM_BATCH) * GEMM_BATCH
    if padded_n == n:
        a_pad, b_pad = a, b
    else:
        a_pad = a.new_zeros(padded_n, *a.shape[1:])
        b_pad = b.new_zeros(padded_n, *b.shape[1:])
        a_pad[:n], b_pad[:n] = a, b
    if out is None or padded_n != n:
        out = a.new_empty(padded_n, a.shape[1], b.shape[2])
    for i in range(0, padded_n, GEMM_BATCH):
        torch.bmm(a_pad[i : i + GEMM_BATCH], b_pad[i : i + GEMM_BATCH], out=out[i : i + GEMM_BATCH])
    return out[:n]


def _plan(q_lens: list[int], kv_lens: list[int], kv_slots: list[torch.Tensor]) -> _Meta:
    """The work items of a batch (on CPU; moved to the device by `prepare`)."""
    tile_rows, item_tile, item_block, key_slots, q_pos, out_rows = [], [], [], [], [], []
    row = num_tiles = 0
    offsets, key_offsets = torch.arange(QUERY_TILE), torch.arange(KEY_BLOCK)
    for q_len, kv_len, slots in zip(q_lens, kv_lens, kv_slots):
        first, slots = kv_len - q_len, slots.cpu()
        t0 = first // QUERY_TILE
        pos = (t0 + torch.arange((kv_len - 1) // QUERY_TILE + 1 - t0))[:, None] * QUERY_TILE + offsets  # (nt, QT)
        present = (pos >= first) & (pos < kv_len)
        tile_rows.append(torch.where(present, row + pos - first, 0))
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
    pad = -len(item_tile_t) % GEMM_BATCH  # empty items: any query, every key masked, merged into a spare tile
    item_rows = torch.cat([torch.cat(tile_rows)[item_tile_t], item_tile_t.new_zeros(pad, QUERY_TILE)])
    key_slots_t = torch.cat([key_slots_t, key_slots_t[:1].expand(pad, KEY_BLOCK)])
    q_pos_t = torch.cat([q_pos_t, torch.full((pad, QUERY_TILE), -1)])
    kp = torch.cat([item_block_t, item_block_t.new_zeros(pad)])[:, None] * KEY_BLOCK + key_offsets
    hidden = kp[:, None, :] > q_pos_t[:, :, None]
    return _Meta(num_tiles=num_tiles, item_rows=item_rows.view(-1), key_slots=key_slots_t.view(-1),
                 key_bias=torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf")), key_weight=(~hidden).float(),
                 item_tile=torch.cat([item_tile_t, torch.full((pad,), num_tiles)]),
                 item_block=torch.cat([item_block_t, item_block_t.new_zeros(pad)]),
                 one_block=len(item_tile_t) == num_tiles, out_rows=torch.cat(out_rows))


class BatchInvariantBackend(AttentionBackend):
    name = "batch_invariant"

    def prepare(self, batch: ForwardBatch) -> None:
        meta = _plan(batch.q_lens, batch.kv_lens, batch.kv_slots)
        dev, dtype = batch.input_ids.device, batch.pool.dtype
        batch.attn_meta = _Meta(
            meta.num_tiles, meta.item_rows.to(dev), meta.key_slots.to(dev), meta.key_bias.to(dev, dtype),
            meta.key_weight.to(dev, dtype), meta.item_tile.to(dev), meta.item_block.to(dev),
            one_block=meta.one_block, out_rows=meta.out_rows.to(dev))

    def forward(self, q: torch.Tensor, layer_id: int, scale: float, batch: ForwardBatch,
                q_tail: torch.Tensor | None = None) -> torch.Tensor:
        q = joined(q, q_tail)
        meta: _Meta = batch.attn_meta
        k_buf, v_buf = batch.pool.k[layer_id], batch.pool.v[layer_id]
        num_kv, head_dim, v_dim = k_buf.shape[1], k_buf.shape[2], v_buf.shape[2]
        num_items, (t, num_heads, _) = len(meta.key_bias), q.shape
        group, rows = num_heads // num_kv, QUERY_TILE * num_heads // num_kv
        # Head-major throughout: queries (Hkv * items, QT * G, D), keys (Hkv * items, KB, D), scores
        # (Hkv * items, QT * G, KB), so each GEMM is one batched call over every (kv head, item) pair.
        qs = torch.mul(q.view(t, num_kv, group, head_dim).transpose(0, 1), scale,
                       out=q.new_empty(num_kv, t, group, head_dim))
        qi = qs.index_select(1, meta.item_rows).view(num_kv * num_items, rows, head_dim)
        if batch.pool.is_fp8:  # dequantized rows: a function of each stored row alone, so still invariant
            kr, vr = batch.pool.rows(layer_id, meta.key_slots)
            ki = _head_major(kr)
            vi = ki[..., :v_dim] if batch.pool.layout.v_shape is None else _head_major(vr)
        else:
            ki = _gather_head_major(k_buf, meta.key_slots)
            if v_buf.data_ptr() == k_buf.data_ptr() and v_buf.stride() == k_buf.stride():  # values lead the keys
                vi = ki[..., :v_dim]
            else:
                vi = _gather_head_major(v_buf, meta.key_slots)
        scores = fixed_bmm(qi, ki.transpose(1, 2))
        scores = scores.view(num_kv, num_items, QUERY_TILE, group, KEY_BLOCK)
        scores.add_(meta.key_bias[None, :, :, None, :])
        m = scores.amax(dim=-1)  # (Hkv, items, QT, G); -inf where a query sees no key of the block
        # exp is fast only where its result is a normal number: arguments below EXP_FLOOR (hidden keys: -inf)
        # are raised to it, and the hidden keys' p is then zeroed exactly by their weight.
        p = torch.sub(scores, _finite(m)[..., None], out=scores).clamp_(min=EXP_FLOOR).exp_()
        p.mul_(meta.key_weight[None, :, :, None, :])
        l = p.sum(dim=-1).view(num_kv, num_items, rows)
        p = p.view(num_kv, num_items, rows, KEY_BLOCK)
        o = fixed_bmm(p.view(num_kv * num_items, rows, KEY_BLOCK), vi).view(num_kv, num_items, rows, v_dim)
        if not meta.one_block:
            l, o = merge_blocks(meta.item_tile, meta.item_block, meta.num_tiles + 1,
                                m.view(num_kv, num_items, rows), l, o)
        o_rows = o.view(num_kv, -1, group, v_dim).index_select(1, meta.out_rows)  # (Hkv, T, G, Dv)
        l_rows = l.view(num_kv, -1, group).index_select(1, meta.out_rows)
        out = q.new_empty(t, num_kv, group, v_dim)
        torch.div(o_rows, l_rows[..., None], out=out.transpose(0, 1))
        return out.view(t, num_heads, v_dim)


def _gather_head_major(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Pool rows (slots, Hkv, D) at `slots` (items * KEY_BLOCK,) -> (Hkv * items, KEY_BLOCK, D): one gather
    along the pool's leading dim, then one copy into head-major order (gathering along a transposed pool's
    middle dim instead walks the whole pool)."""
    return _head_major(buf.index_select(0, slots))


def _head_major(rows: torch.Tensor) -> torch.Tensor:
    """Gathered rows (items * KEY_BLOCK, Hkv, D) -> (Hkv * items, KEY_BLOCK, D)."""
    num_kv, dim = rows.shape[1:]
    return rows.view(-1, KEY_BLOCK, num_kv, dim).permute(2, 0, 1, 3).reshape(-1, KEY_BLOCK, dim)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """m with -inf raised to the lowest finite value: x - m stays -inf for x = -inf, and exp of it 0."""
    return m.clamp(min=torch.finfo(m.dtype).min)


def merge_blocks(item_tile: torch.Tensor, item_block: torch.Tensor, num_tiles: int, m: torch.Tensor,
                 l: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile, sum_items l * exp(m - M) and sum_items o * exp(m - M), M the tile's max m, the items of a tile
    listed in ascending block order. m, l (Hkv, items, R); o (Hkv, items, R, Dv) -> (Hkv, tiles, R[, Dv])."""
    shape = (m.shape[0], num_tiles, m.shape[2])
    tile_m = m.new_full(shape, float("-inf")).scatter_reduce_(1, item_tile[None, :, None].expand_as(m), m, "amax")
    weight = torch.exp(m - _finite(tile_m).index_select(1, item_tile))
    return (ordered_sum(l * weight, item_tile, item_block, num_tiles),
            ordered_sum(o * weight[..., None], item_tile, item_block, num_tiles))


def ordered_sum(x: torch.Tensor, item_tile: torch.Tensor, item_block: torch.Tensor, num_tiles: int) -> torch.Tensor:
    """x (Hkv, items, ...) summed per tile along dim 1 as -0.0 + x_block0 + x_block1 + ... (-0.0 is the exact
    identity of addition). On CPU one index_add_: along dim 1 of a 3- or 4-dim tensor it runs one slice add per
    item in list order (dims 0 and last may take scatter_add's path instead). Elsewhere index_add_ uses atomics,
    so the items are placed in a dense (tile, block) grid, absent ones -0.0, and the blocks added in a loop."""
    shape = (x.shape[0], num_tiles, *x.shape[2:])
    if x.is_cpu:
        return x.new_full(shape, -0.0).index_add_(1, item_tile, x)
    num_blocks = int(item_block.max()) + 1
    dense = x.new_full((x.shape[0], num_tiles * num_blocks, *x.shape[2:]), -0.0)
    dense = dense.index_copy_(1, item_tile * num_blocks + item_block, x).view(x.shape[0], num_tiles, num_blocks,
                                                                             *x.shape[2:])
    total = dense[:, :, 0]
    for b in range(1, num_blocks):
        total = total + dense[:, :, b]
    return total
