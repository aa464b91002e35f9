"""Blocks shared by the model families: the pre-norm decoder layer and the embed -> layers -> norm trunk.

Attribute names are the HF checkpoint names (self_attn, mlp, input_layernorm, post_attention_layernorm,
embed_tokens, layers, norm), so weights load by name identity.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        out, residual = self.forward_residual(x, batch, None)
        return residual + out

    def forward_residual(self, x: torch.Tensor, batch: ForwardBatch,
                         residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it). Adding the two is left to the next norm, which does it in its
        own kernel (forward_add): one launch per layer fewer, the same sums."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        h, residual = self.post_attention_layernorm.forward_add(self.self_attn(h, batch), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer.forward_residual(x, batch, residual)
        return self.norm.forward_add(x, residual)[0]
