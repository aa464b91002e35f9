"""Multi-head latent attention (DeepSeek-V2/V3): the weight-absorbed form for decode rows; long prefill chunks
take the standard form (layers/mla_prefill.py).

Per token the pool stores only [c | k_pe]: the normalised compressed latent c (kv_lora_rank) and the rotated
rope key shared by all heads (qk_rope_head_dim). kv_b_proj's per-head blocks W_UK (nope x C) and W_UV (v x C)
are folded into the query and the output instead of expanding K and V:

    q_nope . (W_UK c) = (W_UK^T q_nope) . c        so  q = [W_UK^T q_nope | q_pe],  k = [c | k_pe]
    sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j)    so  V = c, and the latent output is mapped by W_UV.

The absorbed weights are views of kv_b_proj.weight, so they need no refresh after loading or `.to()` (the
standard-form prefill's padded copy, `padded_kv_b`, is rebuilt after a `.to()`).

Methods, chosen from the KernelConfig at construction: the per-head matmul (layers/methods.py) and how the new
tokens' latents are normalised, rotated and stored (FusedRopeStore: one Triton kernel where the attention
backend supports it; RopeThenStore: norm, rope and the backend's store_kv).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers import mla_prefill
from deepinfer_rt.layers.fp8 import dense_linear_method
from deepinfer_rt.layers.kernel_config import KernelConfig, current_kernel_config
from deepinfer_rt.layers.linear import Linear, MergedLinear
from deepinfer_rt.layers.methods import head_matmul_method
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


class RopeThenStore:
    """The new tokens' latents normalised (kv_a_layernorm), q_pe and k_pe rotated (rotary_emb), [c | k_pe] stored
    through the backend's store_kv."""

    def apply(self, layer: MLAttention, q: torch.Tensor, kv_a: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q (T, H, nope + R), kv_a (T, C + R) -> q with its rope part rotated."""
        t = q.shape[0]
        q_nope, q_pe = q.split([layer.nope_dim, layer.rope_dim], dim=-1)
        latent, k_pe = kv_a.split([layer.kv_lora_rank, layer.rope_dim], dim=-1)
        latent = layer.kv_a_layernorm(latent)  # (T, C)
        k_pe = k_pe.reshape(t, 1, layer.rope_dim)
        in_place = layer.rotary_emb.in_place(q_pe, k_pe)
        q_pe, k_pe = layer.rotary_emb(batch.positions, q_pe, k_pe)
        k = torch.cat([latent.unsqueeze(1), k_pe], dim=-1)  # (T, 1, C + R)
        batch.backend.store_kv(batch, layer.layer_id, k, None)
        return q if in_place else torch.cat([q_nope, q_pe], dim=-1)  # else q_pe was rotated into a new tensor


class FusedRopeStore(RopeThenStore):
    """GPU, not batch-invariant: norm, both rotations (q_pe in place) and the store in one Triton kernel, for
    backends that keep the pool as it writes it (AttentionBackend.is_rope_store_supported). pdl: a programmatic
    dependent launch (KernelConfig.uses_pdl)."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl

    def apply(self, layer: MLAttention, q: torch.Tensor, kv_a: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if not batch.backend.is_rope_store_supported:
            return super().apply(layer, q, kv_a, batch)
        from deepinfer_kernels.elementwise import mla_rope_store

        q_pe = q[..., layer.nope_dim:]
        norm, rope = layer.kv_a_layernorm, layer.rotary_emb
        cos, sin = rope.tables(q.device)
        mla_rope_store(kv_a, norm.weight, norm.eps, q_pe, batch.positions, cos, sin, rope.interleave,
                       batch.pool.k[layer.layer_id], batch.out_slots, pdl=self.pdl)
        return q


def rope_store_method(config: KernelConfig) -> RopeThenStore:
    return FusedRopeStore(config.uses_pdl) if config.is_triton and not config.is_batch_invariant else RopeThenStore()


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        kernel_config = current_kernel_config()
        self.layer_id = layer_id
        self.num_heads = config.num_heads
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_lora = config.q_lora_rank > 0
        hidden, q_dim = config.hidden_size, self.num_heads * (self.nope_dim + self.rope_dim)
        # The projections that read the layer input, q_proj (or q_a_proj) and kv_a_proj_with_mqa, run as one GEMM.
        q_out = config.q_lora_rank if self.q_lora else q_dim
        self.fused_qkv_a_proj = MergedLinear(hidden, {"q": q_out, "kv_a": self.kv_lora_rank + self.rope_dim},
                                             bias=config.attention_bias)
        if config.attention_bias and not self.q_lora:
            nn.init.zeros_(self.fused_qkv_a_proj.bias)  # HF's q_proj has no bias: its part stays 0
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, q_dim)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LORA_NORM_EPS)
        # Its per-head slices feed the absorbed matmuls and the prefill's padded copy: a dense weight, FP8 or not.
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim),
                                method=dense_linear_method(kernel_config))
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=config.attention_bias)
        self.rotary_emb = RotaryEmbedding(config, self.rope_dim, interleave=config.rope_interleave)
        self.scale = mla_softmax_scale(config)
        self._padded_kv_b: torch.Tensor | None = None
        self.head_matmul = head_matmul_method(kernel_config)
        self.rope_store = rope_store_method(kernel_config)
        self.is_padded_prefill = kernel_config.device_type == "cuda" and self.v_dim <= self.nope_dim + self.rope_dim
        """Whether the standard-form prefill expands K and V at the attention's head width through
        `padded_kv_b` (CUDA: flash attention takes one head dim for q, k and v). Chunks that take cuDNN's calls
        (layers.mla_prefill.is_cudnn_chunk) keep V at its own width instead."""
        self.prefix_split = kernel_config.mla_prefix_split
        """Chunks over a cached prefix: two unmasked / causal SDPA calls merged by log-sum-exp (None: where cuDNN
        runs both fast, for aligned chunks; layers.mla_prefill.is_prefix_split)."""
        self.is_padded_kv_b_prebuilt = (kernel_config.is_triton and kernel_config.mla_mha_prefill is not False
                                        and not kernel_config.is_batch_invariant)
        """Whether `process_weights_after_loading` builds `padded_kv_b` (where the standard form can run)."""

    def padded_kv_b(self) -> torch.Tensor:
        """kv_b_proj.weight with each head's W_UK and W_UV rows padded by zero rows to nope + R each: (H * 2 *
        (nope + R), C), so the standard-form prefill's GEMM writes K and V at the attention's head width (GPU;
        v_dim <= nope + R). A copy of 1.5x kv_b_proj's size, built after loading (process_weights_after_loading)
        or on first use, and dropped by any `.to()`."""
        if self._padded_kv_b is None:
            self._padded_kv_b = self._pad_kv_b()
        return self._padded_kv_b

    @torch.no_grad()
    def _pad_kv_b(self) -> torch.Tensor:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        padded = w.new_zeros(self.num_heads, 2, self.nope_dim + self.rope_dim, self.kv_lora_rank)
        padded[:, 0, : self.nope_dim] = w[:, : self.nope_dim]
        padded[:, 1, : self.v_dim] = w[:, self.nope_dim :]
        return padded.view(-1, self.kv_lora_rank)

    def process_weights_after_loading(self) -> None:
        """Build the prefill's padded kv_b now, before the KV pool takes the free memory, where the standard form
        can run (GPU, not switched off)."""
        if self.is_padded_kv_b_prebuilt:
            self.padded_kv_b()

    def _apply(self, fn, recurse=True):
        self._padded_kv_b = None  # moved or cast: rebuilt from the new weights on first use
        return super()._apply(fn, recurse)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK (H, nope, C) and W_UV (H, v, C), views of kv_b_proj.weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        return w_uk, w_uv

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, kv_a = self.fused_qkv_a_proj.split(self.fused_qkv_a_proj(x))  # kv_a (T, C + R) = [latent | k_pe]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.reshape(t, self.num_heads, -1)  # (T, H, nope + R)
        q = self.rope_store.apply(self, q, kv_a, batch)
        plan = batch.mla_plan  # built by the model's prepare_batch (models/deepseek_v3.py)
        if plan.segments:
            o = mla_prefill.prefill_attention(self, plan, q, batch)
        else:
            o = self.absorbed_attention(q, batch)
        return self.o_proj(o.reshape(t, self.num_heads * self.v_dim))

    def absorbed_attention(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q (T, H, nope + R) -> (T, H, v) over the pool's latents (the new tokens' already stored). The
        absorbed query [W_UK^T q_nope | q_pe] goes to the backend as its two parts, sparing a concatenation."""
        w_uk, w_uv = self.absorbed_weights()
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        o = batch.backend.forward(self.head_matmul.apply(q_nope, w_uk), self.layer_id, self.scale, batch,
                                  q_tail=q_pe)
        return self.head_matmul.apply(o, w_uv.transpose(1, 2))  # o (T, H, C)
