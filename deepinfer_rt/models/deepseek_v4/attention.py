"""DeepSeek-V4 attention: shared-KV multi-query attention over sliding-window keys plus compressed entries.

One KV head serves as both key and value (K = V). Queries and keys are rotated on their trailing rope_dim
channels ('main' rope for sliding layers, 'compress' rope for CSA/HCA); since V carries that rotation too, the
output's rope channels are rotated back by the query position. A learned per-head sink joins every softmax
denominator. The heads' outputs are projected per group (wo_a, block diagonal over o_groups) then mixed (wo_b).

Checkpoint names: attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink, compressor.*, indexer.*}.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.cache.kv_pool import KVPool
from deepinfer_rt.layers import batch_invariant
from deepinfer_rt.models.deepseek_v4 import invariant as v4_invariant
from deepinfer_rt.layers.linear import Linear
from deepinfer_rt.models.deepseek_v4.batch import AttnGroup, V4Batch
from deepinfer_rt.models.deepseek_v4.common import (CSA, SLIDING, PoolColumns, V4Config, V4RMSNorm, V4Rotary,
                                           apply_rope, unweighted_rms_norm)
from deepinfer_rt.models.deepseek_v4.compressor import Compressor, Indexer


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int, rotary: V4Rotary):
        super().__init__()
        self.layer_id = layer_id
        layer_type = cfg.layer_types[layer_id]
        self.cols = PoolColumns.for_layer(cfg, layer_type)
        self.ratio = cfg.ratio(layer_type)
        self.num_heads, self.head_dim, self.o_groups = cfg.num_heads, cfg.head_dim, cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim)
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        self.norm = V4RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(cfg.num_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(cfg.num_heads))
        self.compressor = (Compressor(cfg, cfg.head_dim, self.ratio, overlap=layer_type == CSA, rotary=rotary)
                           if layer_type != SLIDING else None)
        self.indexer = Indexer(cfg, self.ratio, rotary) if layer_type == CSA else None

    def forward(self, x: torch.Tensor, vb: V4Batch, pool: KVPool) -> torch.Tensor:
        t, c = x.shape[0], self.cols
        buf = pool.k[self.layer_id].view(pool.num_slots, -1)
        q_residual = self.q_norm(self.wq_a(x))
        cos, sin = self.rotary.cos_sin(vb.positions)
        q = unweighted_rms_norm(self.wq_b(q_residual).view(t, self.num_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos, sin)
        buf[vb.out_slots, c.swa] = apply_rope(self.norm(self.wkv(x)), cos, sin).to(buf.dtype)
        if self.compressor is not None:
            self.compressor.store(x, buf, vb.out_slots, c.kv, c.gate)
            self.compressor.compress(buf, vb.windows[self.ratio], c.kv, c.gate, c.entry)
        if self.indexer is not None:
            self.indexer.compressor.store(x, buf, vb.out_slots, c.idx_kv, c.idx_gate)
            self.indexer.compressor.compress(buf, vb.windows[self.ratio], c.idx_kv, c.idx_gate, c.idx_entry)
        out = torch.empty_like(q)
        for group in vb.groups:
            out[group.rows] = self._attend(group, q, x, q_residual, vb.positions, buf)
        out = apply_rope(out, cos, -sin)  # undo the rotation V carried into the output
        grouped = out.reshape(t, self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # (g, o_lora_rank, H*D/g)
        if batch_invariant.is_enabled():
            return self.wo_b(batch_invariant.head_matmul(grouped, w.transpose(1, 2)).reshape(t, -1))
        return self.wo_b(torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, -1))

    def _attend(self, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
                positions: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """Attention of one group's queries -> (G*Q, H, D)."""
        if batch_invariant.is_enabled():
            return self._attend_invariant(g, q, x, q_residual, positions, buf)
        # Column views first, so the gathers read only the columns used, not whole pool rows.
        keys, mask = buf[:, self.cols.swa][g.swa_slots], g.swa_mask  # (G, L, D), (G, Q, L)
        if self.ratio:
            slots, visible = g.entry_slots[self.ratio], g.entry_mask[self.ratio]  # (G, E), (G, Q, E)
            if self.indexer is not None:
                visible = self.indexer.select(x[g.rows], q_residual[g.rows], positions[g.rows],
                                              buf[:, self.cols.idx_entry][slots], visible)
            keys = torch.cat([keys, buf[:, self.cols.entry][slots]], dim=1)
            mask = torch.cat([mask, visible], dim=2)
        qg = q[g.rows].view(g.num_seqs, g.q_len, self.num_heads, self.head_dim)
        scores = torch.einsum("gqhd,gld->gqhl", qg, keys) * self.head_dim ** -0.5
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        sink = self.attn_sink.to(scores.dtype).view(1, 1, -1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        out = torch.einsum("gqhl,gld->gqhd", probs.to(keys.dtype), keys)
        return out.reshape(-1, self.num_heads, self.head_dim)

    def _attend_invariant(self, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
                          positions: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        """_attend with each query's keys in its own fixed blocks (models/deepseek_v4/invariant.py)."""
        entry_slots = entry_mask = None
        if self.ratio:
            entry_slots, entry_mask = g.entry_slots[self.ratio], g.entry_mask[self.ratio]
            if self.indexer is not None:
                entry_mask = self.indexer.select(x[g.rows], q_residual[g.rows], positions[g.rows],
                                                 buf[:, self.cols.idx_entry][entry_slots], entry_mask)
        slots, valid, is_entry = v4_invariant.key_lists(g.swa_slots, g.swa_mask, entry_slots, entry_mask)
        keys = buf[:, self.cols.swa][slots]
        if entry_slots is not None:
            keys = torch.where(is_entry[..., None], buf[:, self.cols.entry][slots], keys)
        return v4_invariant.attend(q[g.rows], keys.to(q.dtype), valid, self.head_dim ** -0.5, self.attn_sink)
