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

from typing import Callable

import torch
from torch import nn

from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import Linear, MergedLinear
from deepinfer_rt.layers.methods import linear_method
from deepinfer_rt.models.deepseek_v4.batch import Windows
from deepinfer_rt.models.deepseek_v4.common import LayerKV, V4Config, V4RMSNorm, V4Rotary
from deepinfer_rt.models.deepseek_v4.methods import v4_method


class Compressor(nn.Module):
    def __init__(self, cfg: V4Config, head_dim: int, ratio: int, overlap: bool, rotary: V4Rotary):
        super().__init__()
        width = (2 if overlap else 1) * head_dim
        self.head_dim, self.ratio, self.overlap, self.rotary = head_dim, ratio, overlap, rotary
        # 16-bit in every checkpoint, quantized ones too (the V4 releases ship these without a scale); wkv and
        # wgate as one product (checkpoint names load into it: DeepseekV4ForCausalLM.packed_modules).
        self.wkvgate = MergedLinear(cfg.hidden_size, {"wkv": width, "wgate": width},
                                    method=linear_method(current_kernel_config()))
        self.ape = nn.Parameter(torch.empty(ratio, width))
        self.norm = V4RMSNorm(head_dim, cfg.rms_norm_eps)
        self.method = v4_method(current_kernel_config())

    def store(self, x: torch.Tensor, buf: torch.Tensor, slots: torch.Tensor, kv_cols: slice,
              gate_cols: slice) -> None:
        """Keep the new tokens' projections (T, width) in their pool rows, one store: PoolColumns places the gate
        columns right after the kv columns in both pool layouts."""
        assert gate_cols.start == kv_cols.stop, (kv_cols, gate_cols)
        buf[slots, kv_cols.start : gate_cols.stop] = self.wkvgate(x)

    def compress(self, kv_state: LayerKV, win: Windows, kv_cols: slice, gate_cols: slice,
                 store: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Write the entry of every window completed in this step into its entry row."""
        if win.num == 0:
            return
        pooled = self.method.window_pool(kv_state.recent, kv_cols, gate_cols, win, self.ape, self.head_dim,
                                         self.overlap)
        cos, sin = self.rotary.cos_sin(win.positions)
        store(win.end, self.method.rope(self.norm(pooled), cos, sin))


class Indexer(nn.Module):
    def __init__(self, cfg: V4Config, ratio: int, rotary: V4Rotary):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rotary = rotary
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads, method=linear_method(current_kernel_config()))
        self.compressor = Compressor(cfg, self.head_dim, ratio, overlap=True, rotary=rotary)
        self.method = v4_method(current_kernel_config())

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """x (G*Q, hidden), q_residual (G*Q, q_lora), positions (G*Q,), keys (G, E, Di), visible (G, Q, E)
        -> (G, Q, E) True for the entries each query attends to."""
        cos, sin = self.rotary.cos_sin(positions)
        q = self.method.rope(self.wq_b(q_residual).view(-1, self.num_heads, self.head_dim), cos, sin)
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5
        return self.method.index_select(self, q, keys, weights, visible)
