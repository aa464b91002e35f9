"""DeepSeek-V4 mixture of experts: sqrtsoftplus routing, hash routing, clamped SwiGLU experts.

    ffn.gate.weight (E, H), ffn.gate.bias (E,)          'moe' layers: top-k of scores + bias (the bias steers
                                                          the choice, never the weights)
    ffn.gate.tid2eid (vocab, k)                          'hash_moe' layers: experts fixed by the token id
    ffn.experts.gate_up_proj (E, 2I, H), down_proj (E, H, I)  fused from the per-expert w1 (gate), w3 (up), w2;
                                                          quantized checkpoints add their scales (FP8 blocks
                                                          or MXFP4, layers/expert_weights.py; MXFP4 stays
                                                          4-bit on CUDA for the fused MXFP4 MoE)
    ffn.shared_experts.{w1, w2, w3}                      one always-on expert of width I

Weights are the chosen experts' scores renormalised to sum 1, times routed_scaling_factor. SwiGLU clamps
gate <= limit and |up| <= limit before silu(gate) * up.
"""
from __future__ import annotations

import torch
from torch import nn

from deepinfer_rt.layers.expert_weights import clamped_expert_weights_method
from deepinfer_rt.layers.fp8 import apply_keeping_quantized
from deepinfer_rt.layers.kernel_config import current_kernel_config
from deepinfer_rt.layers.linear import Linear, MergedLinear
from deepinfer_rt.models.deepseek_v4.common import V4Config
from deepinfer_rt.models.deepseek_v4.methods import V4Method, v4_method


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, method: V4Method) -> torch.Tensor:
    return method.clamped_swiglu(gate, up, limit)


class V4Router(nn.Module):
    def __init__(self, cfg: V4Config, is_hash: bool, vocab_size: int):
        super().__init__()
        e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.top_k, self.scoring_func, self.scaling = k, cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        if is_hash:
            self.tid2eid = nn.Parameter(torch.zeros(vocab_size, k, dtype=torch.long), requires_grad=False)
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
        self.method = v4_method(current_kernel_config())

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """The weight as the model dtype left it, held in fp32 (exact): the router's fp32 product would otherwise
        cast it at every step (a launch, and the weight read and written again)."""
        self.weight.data = self.weight.data.float()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, H) -> weights (T, k) fp32, expert ids (T, k) (methods.V4Method.route)."""
        return self.method.route(self, x, input_ids)


class ClampedExperts(nn.Module):
    cast_as_built = True  # models/loader._cast_as_built: to the model dtype as soon as built (dummy weights)

    def __init__(self, cfg: V4Config):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.limit = e, cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        config = current_kernel_config()
        self.method = v4_method(config)
        self.weights_method = clamped_expert_weights_method(config)
        self.weights_method.create_weights(self)
        self.fused_moe = None
        """CUDA (Triton, not batch-invariant), 16/32-bit experts: deepinfer_kernels.fused_moe with the clamp, which
        sorts the pairs on the device (no expert counts read back: CUDA graphs capture it)."""
        if config.is_triton and not config.is_batch_invariant and not self.weights_method.is_quantized:
            from deepinfer_kernels.fused_moe import fused_moe  # Triton: CUDA builds only

            self.fused_moe = fused_moe

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        self.weights_method.process_weights_after_loading(self)

    def _apply(self, fn, recurse=True):
        return apply_keeping_quantized(self, fn, lambda f: super(ClampedExperts, self)._apply(f, recurse))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(token, slot) pairs grouped by expert, one matmul per expert hit, slots summed per token; experts kept
        quantized (MXFP4 on CUDA) run their method's fused kernel instead."""
        if self.weights_method.is_quantized:
            return self.weights_method.apply(self, x, weights, ids)
        if self.fused_moe is not None:
            return self.fused_moe(x.contiguous(), self.gate_up_proj, self.down_proj, weights, ids,
                                  swiglu_limit=self.limit)
        m, linear = self.method, self.method.linear.linear
        t, k = ids.shape
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[order // k]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                gate, up = linear(xs[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                ys[rows] = linear(clamped_swiglu(gate, up, self.limit, m), self.down_proj[e])
            start += n
        out = torch.empty_like(ys)
        out[order] = ys
        weighted = out.view(t, k, -1) * weights.unsqueeze(-1).to(out.dtype)
        return m.middle_sum(weighted, dim=1)


class SharedExpert(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.limit = cfg.swiglu_limit
        # w1 and w3 as one product (checkpoint names w1 / w3 load into it: DeepseekV4ForCausalLM.packed_modules)
        self.w13 = MergedLinear(cfg.hidden_size, {"w1": cfg.moe_intermediate_size, "w3": cfg.moe_intermediate_size})
        self.w2 = Linear(cfg.moe_intermediate_size, cfg.hidden_size)
        self.method = v4_method(current_kernel_config())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13.split(self.w13(x))
        return self.w2(clamped_swiglu(gate, up, self.limit, self.method))


class V4MoE(nn.Module):
    """Router `gate`, routed experts, shared expert. gate_temp divides the router's input (V4.1's; 1 in V4)."""

    def __init__(self, cfg: V4Config, gate: V4Router, gate_temp: float = 1.0):
        super().__init__()
        self.gate_temp = gate_temp
        self.gate = gate
        self.experts = ClampedExperts(cfg)
        self.shared_experts = SharedExpert(cfg)
        self.expert_parallel = None
        """The expert-parallel hook, as on layers/moe.py MoE (routing, hash routing included, stays here)."""

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x / self.gate_temp if self.gate_temp != 1.0 else x, input_ids)
        if self.expert_parallel is not None:
            return self.expert_parallel(self, x, weights, ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)
