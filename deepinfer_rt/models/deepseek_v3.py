"""DeepSeek-V3 and DeepSeek-V2: MLA attention, dense MLP in the first layers, MoE with shared experts after.

V2 and V3 differ only in configuration (router scoring/top-k method, rope layout), which the shared blocks read
from ModelConfig. Multi-token-prediction layers stored after the last layer are not part of this model
(speculative decoding loads them as a drafter: deepinfer_rt/speculative/mtp.py).
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
from deepinfer_rt.layers.mla_prefill import plan_for
from deepinfer_rt.layers.mlp import GatedMLP
from deepinfer_rt.layers.moe import MoE, fuse_expert_weights
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.blocks import DecoderLayer, DecoderModel

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def is_moe_layer(config: ModelConfig, layer_id: int) -> bool:
    return (config.is_moe and layer_id >= config.first_k_dense_replace
            and layer_id % config.moe_layer_freq == 0)


class DeepseekV3ForCausalLM(CausalLM):
    packed_modules = [("gate_up_proj", "gate_proj", "gate"), ("gate_up_proj", "up_proj", "up"),
                      ("fused_qkv_a_proj", "q_proj", "q"), ("fused_qkv_a_proj", "q_a_proj", "q"),
                      ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "kv_a")]

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.model = DecoderModel(config, lambda i: DecoderLayer(
            config, MLAttention(config, i),
            MoE(config) if is_moe_layer(config, i) else GatedMLP(config.hidden_size, config.intermediate_size)))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    @staticmethod
    def kv_layout(config: ModelConfig) -> KVLayout:
        return KVLayout(config.num_layers, (1, config.kv_lora_rank + config.qk_rope_head_dim), None,
                        config.kv_lora_rank, is_fp8_supported=True)

    def prepare_batch(self, batch: ForwardBatch) -> None:
        batch.mla_plan = plan_for(batch, self.kernel_config)  # which rows take MLA's standard-form prefill

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
