"""Multi-head latent attention (DeepSeek-V2/V3): the weight-absorbed form for decode rows; long prefill chunks
take the standard form (layers/mla_prefill.py).

Per token the pool stores only [c | k_pe]: the normalised compressed latent c (kv_lora_rank) and the rotated
rope key shared by all heads (qk_rope_head_dim). kv_b_proj's per-head blocks W_UK (nope x C) and W_UV (v x C)
are folded into the query and the output instead of expanding K and V:

    q_nope . (W_UK c) = (W_UK^T q_nope) . c        so  q = [W_UK^T q_nope | q_pe],  k = [c | k_pe]
    sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j)    so  V = c, and the latent output is mapped by W_UV.

The absorbed weights are views of kv_b_proj.weight, so they need no refresh after loading or `.to()`.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers import mla_prefill
from deepinfer_rt.layers.batch_invariant import head_matmul
from deepinfer_rt.layers.linear import Linear
from deepinfer_rt.layers.norm import RMSNorm
from deepinfer_rt.layers.rotary import RotaryEmbedding

# The DeepSeek (and HF) modeling code builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps,
# not config.rms_norm_eps.
_LORA_NORM_EPS = 1e-6


def mla_softmax_scale(config: ModelConfig) -> float:
    """qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2 when the rope is scaled (HF
    yarn_apply_mscale): the rotary cos/sin carry only the mscale/mscale_all_dim ratio."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_scaling or {}
    mscale_all_dim = rope.get("mscale_all_dim", 0)
    if mscale_all_dim and rope["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(rope["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_lora = config.q_lora_rank > 0
        hidden, q_dim = config.hidden_size, self.num_heads * (self.nope_dim + self.rope_dim)
        if self.q_lora:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=config.attention_bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, q_dim)
        else:
            self.q_proj = Linear(hidden, q_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=config.attention_bias)
        self.rotary_emb = RotaryEmbedding(config, self.rope_dim, interleave=config.rope_interleave)
        self.scale = mla_softmax_scale(config)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, nope, C) and W_UV (H, v, C), views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        return w_uk, w_uv

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # (T, C)
        q_pe, k_pe = self.rotary_emb(batch.positions, q_pe, k_pe.reshape(t, 1, self.rope_dim))
        k = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # (T, 1, C + R)
        batch.backend.store_kv(batch, self.layer_id, k, None)
        plan = mla_prefill.plan_for(batch)
        if plan.segments:
            o = mla_prefill.prefill_attention(self, plan, q_nope, q_pe, batch)
        else:
            o = self.absorbed_attention(q_nope, q_pe, batch)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def absorbed_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """(T, H, nope), (T, H, R) -> (T, H, v) over the pool's latents (the new tokens' already stored)."""
        w_uk, w_uv = self.absorbed_weights()
        q = torch.cat([head_matmul(q_nope, w_uk), q_pe], dim=-1)  # (T, H, C + R)
        o = batch.backend.forward(q, self.layer_id, self.scale, batch)  # (T, H, C)
        return head_matmul(o, w_uv.transpose(1, 2))
