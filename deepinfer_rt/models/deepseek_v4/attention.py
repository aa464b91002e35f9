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
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import GroupedLinear, Linear, MergedLinear
from deepinfer_rt.models.deepseek_v4.batch import V4Batch
from deepinfer_rt.models.deepseek_v4.cache import V4Pool
from deepinfer_rt.models.deepseek_v4.common import CSA, SLIDING, LayerKV, PoolColumns, V4Config, V4RMSNorm, V4Rotary
from deepinfer_rt.models.deepseek_v4.compressor import Compressor, Indexer
from deepinfer_rt.models.deepseek_v4.methods import v4_method


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int, rotary: V4Rotary):
        super().__init__()
        self.layer_id = layer_id
        layer_type = cfg.layer_types[layer_id]
        self.cols = PoolColumns.for_layer(cfg, layer_type)
        """Columns in the per-token layout; compact_cols those of the compact pool (cache.py)."""
        self.compact_cols = {fp8: PoolColumns.compact(cfg, layer_type, fp8) for fp8 in (False, True)}
        self.ratio = cfg.ratio(layer_type)
        self.num_heads, self.head_dim, self.o_groups = cfg.num_heads, cfg.head_dim, cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        # wq_a and wkv as one product of x (checkpoint names load into it: DeepseekV4ForCausalLM.packed_modules)
        self.wqkv_a = MergedLinear(cfg.hidden_size, {"wq_a": cfg.q_lora_rank, "wkv": cfg.head_dim})
        self.q_norm = V4RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim)
        self.norm = V4RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.wo_a = GroupedLinear(cfg.num_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank,
                                  cfg.o_groups)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(cfg.num_heads))
        self.compressor = (Compressor(cfg, cfg.head_dim, self.ratio, overlap=layer_type == CSA, rotary=rotary)
                           if layer_type != SLIDING else None)
        self.indexer = Indexer(cfg, self.ratio, rotary) if layer_type == CSA else None
        self.method = v4_method(current_kernel_config())
        """Default or batch-invariant attention and products (models/deepseek_v4/methods.py)."""

    def layer_kv(self, pool: KVPool) -> LayerKV:
        if isinstance(pool, V4Pool):
            return pool.layer_kv(self.layer_id, self.compact_cols)
        buf = pool.k[self.layer_id].view(pool.num_slots, -1)
        return LayerKV(buf, buf, self.cols)

    def forward(self, x: torch.Tensor, vb: V4Batch, pool: KVPool) -> torch.Tensor:
        t = x.shape[0]
        kv = self.layer_kv(pool)
        c, buf = kv.cols, kv.recent
        q_a, kv_a = self.wqkv_a.split(self.wqkv_a(x))
        q_residual = self.q_norm(q_a)
        cos, sin = self.rotary.cos_sin(vb.positions)
        q = self.method.unweighted_rms_norm(self.wq_b(q_residual).view(t, self.num_heads, self.head_dim), self.eps)
        q = self.method.rope_(q, cos, sin)  # q, the normalised kv and the attention output are step temporaries
        kv.store_swa(vb.out_slots, self.method.rope_(self.norm(kv_a), cos, sin))
        if self.compressor is not None:
            self.compressor.store(x, buf, vb.out_slots, c.kv, c.gate)
            self.compressor.compress(kv, vb.windows[self.ratio], c.kv, c.gate, kv.store_entry)
        if self.indexer is not None:
            self.indexer.compressor.store(x, buf, vb.out_slots, c.idx_kv, c.idx_gate)
            self.indexer.compressor.compress(kv, vb.windows[self.ratio], c.idx_kv, c.idx_gate, kv.store_idx_entry)
        if len(vb.groups) == 1 and vb.groups[0].covers_all:
            out = self.method.attend(self, vb.groups[0], q, x, q_residual, vb.positions, kv)
        else:
            out = torch.empty_like(q)
            for group in vb.groups:
                out[group.rows] = self.method.attend(self, group, q, x, q_residual, vb.positions, kv)
        out = self.method.rope_(out, *self.rotary.cos_sin(vb.positions, inverse=True))  # undo V's rotation
        grouped = self.wo_a.project(out.reshape(t, self.o_groups, -1), self.method.grouped_projection)
        return self.wo_b(grouped.reshape(t, -1))
