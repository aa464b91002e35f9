"""DeepSeek-V4's Triton method (CUDA, not batch-invariant): attention, the indexer, the compressor's pooling and
the mHC Sinkhorn projection through deepinfer_kernels (v4_attention, v4_indexer, v4_pooling, v4_sinkhorn); every
other form is V4Method's.

Attention reads the keys where the pool keeps them: the sliding-window keys and the compressed entries are two
key sources (buffer, rows, mask) of one sparse MQA kernel, so no (G, L, D) copy of the keys is made and the
softmax runs in fp32. For CSA the indexer's choice travels as entry indices, (G, Q, topk) with -1 for none,
instead of V4Method's (G, Q, E) mask: the kernel then reads topk entries per query, not all E. The top-k is
reference.stable_topk, V4Method's rule (ties to the earlier entry).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deepinfer_kernels.reference import stable_topk
from deepinfer_kernels.v4_attention import KeySource, sparse_mqa_attention
from deepinfer_kernels.v4_indexer import index_scores
from deepinfer_kernels.v4_pooling import pool_window
from deepinfer_kernels.v4_sinkhorn import sinkhorn
from deepinfer_rt.models.deepseek_v4.methods import V4Method

if TYPE_CHECKING:
    from deepinfer_rt.models.deepseek_v4.batch import AttnGroup


class V4TritonMethod(V4Method):
    def sinkhorn(self, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return sinkhorn(logits, iters, eps)

    def pool_window(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return pool_window(kv, gate)

    def attend(self, layer: nn.Module, g: AttnGroup, q: torch.Tensor, x: torch.Tensor, q_residual: torch.Tensor,
               positions: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        cols = layer.cols
        sources = [KeySource(buf[:, cols.swa], g.swa_slots, g.swa_mask)]
        if layer.ratio:
            slots, visible = g.entry_slots[layer.ratio], g.entry_mask[layer.ratio]  # (G, E), (G, Q, E)
            if layer.indexer is not None:
                picks = layer.indexer.select(x[g.rows], q_residual[g.rows], positions[g.rows],
                                             KeySource(buf[:, cols.idx_entry], slots), visible)  # (G, Q, k)
                rows = slots.gather(1, picks.clamp(min=0).flatten(1)).view(picks.shape)
                sources.append(KeySource(buf[:, cols.entry], rows.masked_fill(picks < 0, -1)))
            else:
                sources.append(KeySource(buf[:, cols.entry], slots, visible))
        qg = q[g.rows].view(g.num_seqs, g.q_len, layer.num_heads, layer.head_dim)
        out = sparse_mqa_attention(qg, sources, layer.attn_sink, layer.head_dim ** -0.5)
        return out.view(-1, layer.num_heads, layer.head_dim)

    def index_select(self, indexer: nn.Module, q: torch.Tensor, keys: KeySource, weights: torch.Tensor,
                     visible: torch.Tensor) -> torch.Tensor:
        """q (G*Q, H, Di) rotated, keys the group's index keys as a source (buffer, rows (G, E)), weights
        (G*Q, H), visible (G, Q, E) -> (G, Q, min(topk, E)) indices into the group's entries of the best visible
        ones by sum_h w_h * relu(q_h . k), -1 past the visible ones."""
        g, q_len, _ = visible.shape
        scores = index_scores(q.view(g, q_len, indexer.num_heads, indexer.head_dim),
                              weights.view(g, q_len, indexer.num_heads), keys.buf, keys.rows, visible,
                              indexer.head_dim ** -0.5)
        values, picks = stable_topk(scores, indexer.topk)
        return picks.masked_fill(values == float("-inf"), -1)
