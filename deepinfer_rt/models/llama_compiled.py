"""The CPU step compiled: torch.compile (inductor's C++ backend) over the work between attention calls.

A Llama step on CPU is 30 layers of small GEMMs with elementwise glue between them (residual adds, RMSNorm in fp32,
rotary, SiLU * up); run eagerly each glue op is a dispatch and a pass over memory. Compiled, the glue between two
attention calls becomes a few fused C++ loops around the GEMMs:

    embed (eager) -> enter(layer 0) -> attention 0 -> between(0, 1) -> attention 1 -> ... -> leave(last)

    enter     residual (+ x) -> RMSNorm -> QKV -> rotary                        -> q, k, v, residual
    between   o_proj + residual -> RMSNorm -> gate_up -> SiLU * up -> down, then `enter` of the next layer
    leave     o_proj + residual -> ... -> down, then the final norm             -> hidden

Attention stays eager (batch.attention: the KV pool and its metadata are Python). The weights are arguments, not
closures, so the 30 layers share one graph per piece; the token count is dynamic (one graph for T >= 2, one
specialised for T = 1, the lone decode stream). Inductor's caches live under DEEPINFER_CACHE/inductor (unless
the user set TORCHINDUCTOR_CACHE_DIR), so a second start loads the compiled pieces instead of compiling them.

Numerics: the same operations as the eager CPU step, but inductor reorders the RMSNorm reduction and may contract
multiply-adds, so fp32 values differ in the last bits (tokens equal: test/e2e/test_cpu_compile.py). Dense weights
only (quantization=None); when compilation fails (no C++ toolchain) the step warns once and runs eagerly.
"""
from __future__ import annotations

import logging
import os

import torch
import torch._inductor.exc
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
import torch.nn.functional as F

from deepinfer_kernels import reference
from deepinfer_rt.env import get_env
from deepinfer_rt.forward_batch import ForwardBatch

logger = logging.getLogger("deepinfer_rt")

_COMPILER_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError,
                    torch._inductor.exc.CppCompileError)
"""What a missing or broken toolchain raises; other errors (a bad input) propagate as in the eager step."""


def _enter(x, residual, norm, qkv_w, qkv_b, cos, sin, eps: float, num_q: int, num_kv: int, head_dim: int):
    residual = x if residual is None else x + residual
    h = reference.rms_norm(residual, norm, eps)
    qkv = F.linear(h, qkv_w, qkv_b)
    t, half, qk_width = qkv.shape[0], head_dim // 2, (num_q + num_kv) * head_dim
    qk = qkv[:, :qk_width].view(t, num_q + num_kv, head_dim)
    x1, x2 = qk[..., :half], qk[..., half:]
    rot = torch.cat([x1 * cos[..., :half] - x2 * sin, x2 * cos[..., half:] + x1 * sin], dim=-1)
    v = qkv[:, qk_width:].view(t, num_kv, head_dim)
    return rot[:, :num_q], rot[:, num_q:], v, residual


def _mlp(o, residual, o_w, o_b, post_norm, gate_up_w, down_w, eps: float, inter: int):
    residual = F.linear(o.reshape(o.shape[0], -1), o_w, o_b) + residual
    h = reference.rms_norm(residual, post_norm, eps)
    gate_up = F.linear(h, gate_up_w)
    return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], down_w), residual


def _between(o, residual, mlp_args: tuple, enter_args: tuple, cos, sin, eps: float, inter: int, num_q: int,
             num_kv: int, head_dim: int):
    x, residual = _mlp(o, residual, *mlp_args, eps, inter)
    return _enter(x, residual, *enter_args, cos, sin, eps, num_q, num_kv, head_dim)


def _leave(o, residual, mlp_args: tuple, final_norm, eps: float, inter: int):
    x, residual = _mlp(o, residual, *mlp_args, eps, inter)
    return reference.rms_norm(x + residual, final_norm, eps)


def _dense_weights(model) -> list[tuple[tuple, tuple]]:
    """Per layer: (input norm, qkv weight, qkv bias) and (o weight, o bias, post norm, gate_up, down)."""
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append(((layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias),
                    (attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                     mlp.gate_up_proj.weight, mlp.down_proj.weight)))
    return out


def _use_our_inductor_cache() -> None:
    """Point inductor's cache (torch's TORCHINDUCTOR_CACHE_DIR, read whenever it compiles or loads) at
    DEEPINFER_CACHE/inductor, unless the user chose another directory. Importing inductor writes torch's default
    into the variable, so that value counts as unset."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(get_env().inductor_cache_dir)


class CompiledCpuStep:
    """The CPU step compiled; `eager` (models/llama_step.CpuStep) prepares each batch (its rotary tables) and runs
    the step where compiling failed."""

    def __init__(self, eager):
        self.eager = eager
        _use_our_inductor_cache()
        def compile_(fn, options=None):
            return torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True, options=options)

        self.enter, self.between, self.leave = compile_(_enter), compile_(_between), compile_(_leave)
        # A lone decode row's glue is a few hundred elements per loop: forking threads for it costs more than it
        # saves (and stalls when the cores are shared), so the T = 1 pieces run their loops on one thread.
        one = {"cpp.threads": 1}
        self.enter1, self.between1, self.leave1 = (compile_(_enter, one), compile_(_between, one),
                                                   compile_(_leave, one))
        self.is_compiled = True
        """False once compiling failed: the step runs the eager CPU step from then on."""

    def prepare(self, model, batch: ForwardBatch) -> None:
        self.eager.prepare(model, batch)

    def compute_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        return self.eager.compute_logits(model, hidden)

    def forward(self, model, batch: ForwardBatch) -> torch.Tensor:
        if self.is_compiled:
            try:
                return self._compiled_forward(model, batch)
            except _COMPILER_ERRORS as e:  # the eager step computes the same values (KV slots are rewritten)
                logger.warning("the compiled CPU step is unavailable (%s: %s); running the eager step",
                               type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.is_compiled = False
        return self.eager.forward(model, batch)

    def _compiled_forward(self, model, batch: ForwardBatch) -> torch.Tensor:
        trunk, config = model.model, model.config
        weights = model.fast_weights
        if not weights or weights[0][0][1] is not trunk.layers[0].self_attn.qkv_proj.weight:
            weights = model.fast_weights = _dense_weights(model)
        rope = batch.model_meta  # llama_step._Rope, built by the eager step's prepare
        eps, scale, inter = config.rms_norm_eps, config.head_dim**-0.5, config.intermediate_size
        heads = (config.num_heads, config.num_kv_heads, config.head_dim)
        x = trunk.embed_tokens(batch.input_ids)
        cos, sin = rope.cos, rope.sin
        if x.shape[0] > 1:  # one graph for every T >= 2 (T = 1 gets its own, specialised)
            for t in (x, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
            enter, between, leave = self.enter, self.between, self.leave
        else:
            enter, between, leave = self.enter1, self.between1, self.leave1
        q, k, v, residual = enter(x, None, *weights[0][0], cos, sin, eps, *heads)
        for i in range(len(weights)):
            o = batch.attention(q, k, v, i, scale)
            if o.shape[0] > 1:
                torch._dynamo.mark_dynamic(o, 0)
                torch._dynamo.mark_dynamic(residual, 0)
            if i + 1 == len(weights):
                return leave(o, residual, weights[i][1], trunk.norm.weight, eps, inter)
            q, k, v, residual = between(o, residual, weights[i][1], weights[i + 1][0], cos, sin, eps, inter,
                                             *heads)
        raise ValueError("a Llama model has at least one layer")
