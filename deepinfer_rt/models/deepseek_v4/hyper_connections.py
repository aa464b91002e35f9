"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is hc_mult parallel streams.

Before a block, a one-layer perceptron over the RMS-normalised, flattened streams gives per token
  pre  (N,)    weights that collapse the streams into the block input,
  post (N,)    weights that spread the block output back over the streams,
  comb (N, N)  the residual mixing, projected by Sinkhorn-Knopp onto (nearly) doubly-stochastic matrices,
and the block's streams become  out[k] = post[k] * block(sum_j pre[j] x[j]) + sum_j comb[j, k] x[j].
The weights are computed in fp32 (the reference keeps these modules in fp32).

Checkpoint names: layers.i.hc_{attn,ffn}_{fn,base,scale} (loaded as hc_attn.fn, ...), hc_head.hc_{fn,base,scale}.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.models.deepseek_v4.common import V4Config
from deepinfer_rt.models.deepseek_v4.methods import v4_method


class HyperConnection(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        n = cfg.hc_mult
        self.hc_mult, self.iters, self.hc_eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))
        self.method = v4_method(current_kernel_config())
        """Default or batch-invariant (fixed-shape GEMMs, exp-built sigmoids, ordered sums): deepseek_v4/methods.py."""

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (T, N, D) -> pre (T, N), post (T, N), comb (T, N, N), all fp32."""
        n, m = self.hc_mult, self.method
        mix = m.hc_logits(streams.flatten(1), self.fn, self.norm_eps)
        return m.hc_weights(mix, self.base, self.scale, n, self.iters, self.hc_eps)

    def forward(self, streams: torch.Tensor, block) -> torch.Tensor:
        """Run `block` (D -> D per token) between the collapse and the spread of the streams (T, N, D)."""
        pre, post, comb = self.weights(streams)
        y = block(self.method.hc_collapse(pre, streams))
        return self.method.hc_expand(post, y, comb, streams)


class HyperHead(nn.Module):
    """Final collapse of the streams into one hidden state, with sigmoid weights from the streams."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        n = cfg.hc_mult
        self.hc_eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.method = v4_method(current_kernel_config())

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        m = self.method
        pre = m.sigmoid(m.hc_logits(streams.flatten(1), self.hc_fn, self.norm_eps) * self.hc_scale.float()
                        + self.hc_base.float())
        return m.hc_collapse(pre + self.hc_eps, streams)
