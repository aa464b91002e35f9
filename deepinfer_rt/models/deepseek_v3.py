"""DeepSeek-V3 and DeepSeek-V2: MLA attention, dense MLP in the first layers, MoE with shared experts after.

V2 and V3 differ only in configuration (router scoring/top-k method, rope layout), which the shared blocks read
from ModelConfig. Multi-token-prediction layers stored after the last layer are not run and not loaded.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from deepinfer_rt.cache.kv_pool import KVLayout
from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.mla import MLAttention
from deepinfer_rt.layers.mlp import GatedMLP
from deepinfer_rt.layers.moe import MoE, fuse_expert_weights
from deepinfer_rt.layers.norm import RMSNorm
from deepinfer_rt.models.base import CausalLM

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_moe_layer(config: ModelConfig, layer_id: int) -> bool:
    return (config.is_moe and layer_id >= config.first_k_dense_replace
            and layer_id % config.moe_layer_freq == 0)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = MLAttention(config, layer_id)
        self.mlp = (MoE(config) if is_moe_layer(config, layer_id)
                    else GatedMLP(config.hidden_size, config.intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch)
        return self.norm(x)


class DeepseekV3ForCausalLM(CausalLM):
    packed_modules = [("gate_up_proj", "gate_proj", "gate"), ("gate_up_proj", "up_proj", "up")]

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = DeepseekV3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @staticmethod
    def kv_layout(config: ModelConfig) -> KVLayout:
        return KVLayout(config.num_layers, (1, config.kv_lora_rank + config.qk_rope_head_dim), None,
                        config.kv_lora_rank)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        num_layers = self.config.num_layers

        def main_layers():
            for name, tensor in weights:
                m = _LAYER.match(name)
                if m is None or int(m[1]) < num_layers:  # MTP layers come after the last layer
                    yield name, tensor

        super().load_weights(fuse_expert_weights(main_layers(), self.config.n_routed_experts))
