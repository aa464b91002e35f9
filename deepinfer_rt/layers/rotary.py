"""Rotary position embedding with a cos/sin table indexed by absolute position."""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.config import ModelConfig
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.methods import rope_method


def _inv_freq(config: ModelConfig, dim: int) -> tuple[torch.Tensor, float]:
    if not config.rope_scaling:
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    # Scaled variants (yarn, llama3, linear, ...) reuse transformers' own definitions, so they cannot drift.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {k: v for k, v in config.raw.items() if k not in ("architectures", "transformers_version")}
    hf = AutoConfig.for_model(raw.pop("model_type"), **raw)
    rope_type = config.rope_scaling.get("rope_type", config.rope_scaling.get("type"))
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


_SHARED_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
"""(frequencies, scaling, positions, device) -> (cos, sin), kept for the process (one pair per distinct rope)."""


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig, dim: int, interleave: bool = False):
        super().__init__()
        inv_freq, scaling = _inv_freq(config, dim)
        self.interleave = interleave
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq
        self.attention_scaling = scaling
        self.max_position = config.max_position
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        """(cos, sin) per position, built on the first GPU call (the Triton kernel rotates in place)."""
        self.method = rope_method(current_kernel_config())
        """TorchRope or TritonRope (in place), layers/methods.py."""

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Same arithmetic as the HF reference (fp32 outer product, then cos/sin), so fp32 runs match bitwise.
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def in_place(self, *xs: torch.Tensor) -> bool:
        """Whether forward rotates these xs in place (GPU) rather than returning new tensors."""
        return self.method.is_in_place(*xs)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x (T, H, D) by its token's position. On GPU the xs are rotated in place (`in_place`)."""
        return self.method.apply(self, positions, xs)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) (max_position, D/2) fp32 on `device`, for the GPU kernels that rotate. Layers with the same
        frequencies share one pair (V2-Lite's 27 layers at 160K positions would hold 1.1 GB of copies)."""
        from deepinfer_kernels.elementwise import rope_cache

        if self._tables is None or self._tables[0].device != device:
            key = (tuple(self.inv_freq.tolist()), self.attention_scaling, self.max_position, str(device))
            tables = _SHARED_TABLES.get(key)
            if tables is None:
                tables = _SHARED_TABLES[key] = rope_cache(self.inv_freq, self.attention_scaling, self.max_position,
                                                          device)
            self._tables = tables
        return self._tables
