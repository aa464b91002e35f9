"""DeepSeek-V4 KV compressor and lightning indexer, over token state kept in the KV pool.

Compressor: a window of m tokens becomes one entry, the softmax(gate + ape)-weighted sum of the tokens' kv
projections per channel, RMS-normalised and rotated at the window's first position. With `overlap` (CSA) each
token projects two series [Ca | Cb]; entry w pools Cb of window w together with Ca of window w-1 (2m tokens,
stride m; window 0 has no predecessor, whose half gets weight 0).

Indexer (CSA): its own compressor at index_head_dim gives one key per window; a query scores the entries it may
see by sum_h w_h(x) * relu(q_h . k) and keeps the top index_topk.

Checkpoint names: compressor.{wkv, wgate, ape, norm}, indexer.{wq_b, weights_proj, compressor.*}.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.layers import batch_invariant
from deepinfer_rt.models.deepseek_v4 import invariant as v4_invariant
from deepinfer_rt.layers.linear import Linear
from deepinfer_rt.models.deepseek_v4.batch import Windows
from deepinfer_rt.models.deepseek_v4.common import V4Config, V4RMSNorm, V4Rotary, apply_rope


class Compressor(nn.Module):
    def __init__(self, cfg: V4Config, head_dim: int, ratio: int, overlap: bool, rotary: V4Rotary):
        super().__init__()
        width = (2 if overlap else 1) * head_dim
        self.head_dim, self.ratio, self.overlap, self.rotary = head_dim, ratio, overlap, rotary
        self.wkv = Linear(cfg.hidden_size, width)
        self.wgate = Linear(cfg.hidden_size, width)
        self.ape = nn.Parameter(torch.empty(ratio, width))
        self.norm = V4RMSNorm(head_dim, cfg.rms_norm_eps)

    def store(self, x: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor, kv_cols: slice,
              gate_cols: slice) -> None:
        """Keep the new tokens' projections (T, width) in their pool rows."""
        buf[slots, kv_cols] = self.wkv(x)
        buf[slots, gate_cols] = self.wgate(x)

    def compress(self, buf: torch.Tensor, win: Windows, kv_cols: slice, gate_cols: slice,
                 entry_cols: slice) -> None:
        """Write the entry of every window completed in this step into its last token's pool row."""
        if win.num == 0:
            return
        kv_buf, gate_buf = buf[:, kv_cols], buf[:, gate_cols]
        kv, gate = kv_buf[win.cur], gate_buf[win.cur].float() + self.ape.float()  # (N, m, width)
        if self.overlap:
            d = self.head_dim
            prev_gate = gate_buf[:, :d][win.prev].float() + self.ape[:, :d].float()
            prev_gate = prev_gate.masked_fill(~win.has_prev[:, None, None], float("-inf"))
            kv = torch.cat([kv_buf[:, :d][win.prev], kv[..., d:]], dim=1)  # (N, 2m, d)
            gate = torch.cat([prev_gate, gate[..., d:]], dim=1)
        if batch_invariant.is_enabled():
            pooled = v4_invariant.pool_window(kv, gate)
        else:
            pooled = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
        cos, sin = self.rotary.cos_sin(win.positions)
        buf[win.end, entry_cols] = apply_rope(self.norm(pooled), cos, sin).to(buf.dtype)


class Indexer(nn.Module):
    def __init__(self, cfg: V4Config, ratio: int, rotary: V4Rotary):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rotary = rotary
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads)
        self.compressor = Compressor(cfg, self.head_dim, ratio, overlap=True, rotary=rotary)

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """x (G*Q, hidden), q_residual (G*Q, q_lora), positions (G*Q,), keys (G, E, Di), visible (G, Q, E)
        -> (G, Q, E) True for the entries each query attends to."""
        g, q_len, num_entries = visible.shape
        cos, sin = self.rotary.cos_sin(positions)
        q = apply_rope(self.wq_b(q_residual).view(-1, self.num_heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5
        if batch_invariant.is_enabled():
            return self._select_invariant(q, keys, weights, visible)
        q = q.view(g, q_len, self.num_heads, self.head_dim)
        scores = torch.einsum("gqhd,ged->gqhe", q.float(), keys.float()).relu() * self.head_dim ** -0.5
        weights = weights.view(g, q_len, self.num_heads, 1)
        scores = (scores * weights).sum(dim=2).masked_fill(~visible, float("-inf"))  # (G, Q, E)
        picks = scores.topk(min(self.topk, num_entries), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(-1, picks, True)
        return chosen & visible  # picks beyond the visible entries (too few of them) are dropped

    def _select_invariant(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                          visible: torch.Tensor) -> torch.Tensor:
        """select() per query: q (G*Q, H, Di), weights (G*Q, H) (models/deepseek_v4/invariant.py)."""
        g, q_len, num_entries = visible.shape
        per_query = keys.float()[:, None].expand(g, q_len, *keys.shape[1:]).reshape(g * q_len, *keys.shape[1:])
        scores = v4_invariant.index_scores(q.float(), per_query, weights, self.head_dim ** -0.5)
        return v4_invariant.top_k_mask(scores, visible.reshape(g * q_len, -1), self.topk).view(g, q_len, -1)
