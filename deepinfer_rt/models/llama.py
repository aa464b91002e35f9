"""Llama family (SmolLM2, Llama 2/3, Qwen2-style GQA without biases unless configured)."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.cache.kv_pool import KVLayout
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.linear import Linear, MergedLinear
from deepinfer_rt.layers.mlp import GatedMLP
from deepinfer_rt.layers.rotary import RotaryEmbedding
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.blocks import DecoderLayer, DecoderModel
from deepinfer_rt.models.llama_step import llama_step_method


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q, "k": kv, "v": kv}, bias=config.attention_bias)
        self.o_proj = Linear(q, config.hidden_size, bias=config.attention_bias)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim)
        self.scale = self.head_dim**-0.5
        self.is_rope_store_shape = self.head_dim & (self.head_dim - 1) == 0
        """Whether the heads suit the one-launch rope and store (power-of-two head_dim), where the backend takes it."""

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), batch))

    def attend(self, qkv: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The fused QKV projection's output (T, (Hq + 2 Hkv) D) -> the heads' attention output (T, Hq D): rotary,
        the K / V store, attention over the pool (the part between the two projections)."""
        t = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.is_rope_store_fused(batch) and self.rotary_emb.in_place(q, k, v):
            # GPU: both rotations and the K / V store in one launch (four apart), then attention over the pool.
            from deepinfer_kernels.elementwise import gqa_rope_store

            cos, sin = self.rotary_emb.tables(q.device)
            gqa_rope_store(q, k, v, batch.positions, cos, sin, self.rotary_emb.interleave, batch.pool.k[self.layer_id],
                           batch.pool.v[self.layer_id], batch.out_slots)
            return self.attend_stored(q, batch)
        else:
            q, k = self.rotary_emb(batch.positions, q, k)
            o = batch.attention(q, k, v, self.layer_id, self.scale)
        return o.reshape(t, -1)

    def attend_stored(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Rotated queries (T, Hq, D) whose step's K / V are already in the pool -> attention output (T, Hq D)."""
        return batch.backend.forward(q, self.layer_id, self.scale, batch).reshape(q.shape[0], -1)

    def is_rope_store_fused(self, batch: ForwardBatch) -> bool:
        """Whether this step rotates and stores in one launch (power-of-two heads, a backend that takes it)."""
        return self.is_rope_store_shape and batch.backend.is_rope_store_supported


class LlamaForCausalLM(CausalLM):
    packed_modules = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", "gate"), ("gate_up_proj", "up_proj", "up")]

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = DecoderModel(config, lambda i: DecoderLayer(
            config, LlamaAttention(config, i), GatedMLP(config.hidden_size, config.intermediate_size)))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.step_method = llama_step_method(self.kernel_config)
        """The modules, the flat CPU step (models/llama_step.py) or the CUDA row step (models/llama_gpu_step.py)."""
        self.fast_layers: list = []
        """The CPU step's flat list of the layers' weights (built on its first step)."""
        self.fast_weights: list = []
        """The compiled CPU step's per-layer weight tuples (built on its first step)."""

    @staticmethod
    def kv_layout(config: ModelConfig) -> KVLayout:
        shape = (config.num_kv_heads, config.head_dim)
        return KVLayout(config.num_layers, shape, shape, config.head_dim, is_fp8_supported=True)

    def prepare_batch(self, batch: ForwardBatch) -> None:
        self.step_method.prepare(self, batch)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.step_method.forward(self, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.step_method.compute_logits(self, hidden)
