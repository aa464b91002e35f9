"""How a Llama model runs its trunk (embed -> layers -> norm): the module path, or the CPU step.

Chosen once from the KernelConfig when the model is built (`llama_step_method`):

    ModuleStep   the shared blocks as modules (models/blocks.py): the reference, and every device and mode
    CpuStep      CPU, not batch-invariant, unquantized, int8 or Q4_1 weights (DEEPINFER_CPU_FAST_STEP, on by default)
    CompiledCpuStep  the same, dense weights, compiled between attention calls (DEEPINFER_CPU_COMPILE;
                 models/llama_compiled.py)
    GpuRowStep   CUDA, not batch-invariant, unquantized: steps of at most 4 tokens in six launches a layer
                 (DEEPINFER_GPU_ROW_STEP, on by default; models/llama_gpu_step.py)

On CPU a decode step of a small model is mostly host work between the GEMMs (profile:
benchmark/profile_cpu_decode.py, --count-ops for the aten ops a step dispatches per layer): module calls, per-layer
rotary tables, per-tensor rotations. In fp32 CpuStep computes the same values with the same operations in the same
order, so its tokens (and a prefill's hidden states, bit for bit) equal the module path's:

  - the rotary cos/sin of the step's positions are built once in `prepare` (the module path: once per layer),
    and turned into the rotation's factors by products with cached 1 / -1 / 0 constants (exact),
  - q and k, adjacent in the fused QKV output, are rotated together into one tensor, the rotation written as
    x*cos + (x2 | x1)*(-sin | sin) (the module path's x*cos + cat(-x2, x1)*sin: negating a factor or a product
    gives the same bits); a step of few tokens (decode) rotates the whole QKV output, v by the factors 1 and 0
    (the same bits), and splits it once,
  - RMSNorm in fp32 is torch's rms_norm (the same fp32 operations as reference.rms_norm, so the same bits); in
    16 bits the reference's fp32 steps are written out, the normalised fp32 values rounded once as they are
    stored into a buffer the step reuses for every norm, then scaled by the weight in place (7 ops, no allocation),
  - a dense linear is F.linear's own t + mm with the transpose made once; a weight-only quantized linear of a
    small input calls its packed matmul bound to its weight and scales (WeightOnlyLinear.packed_fn),
  - residual adds, and SiLU on the gate half, run in place on tensors the step has just made (an add's operands
    commute bit for bit); splits call torch.split_with_sizes (Tensor.split's Python wrapper cost 3x the op),
  - the layers are walked over a flat list of their weights (no module calls, no per-layer lookups), built
    once the weights are final and rebuilt if they were replaced.

A step of decode rows only (each stream one new token, at most KERNEL_MAX_ROWS) runs each layer as one call of the
decode-row kernels (deepinfer_kernels.cpu_row, kernels/cpu/row_decode.cpp) where they build: in bf16 when the row product is
'kernel' (DEEPINFER_CPU_BF16_GEMV; `auto` picks it where it is fastest), in fp32 unless DEEPINFER_CPU_FP32_ROW=mm.
The kernel takes the same operations and roundings, but sums in another order, so such a step's values differ
from the module path's in the last bits (tokens equal in the tests; fp32 logprobs within 1e-5). On the 2-core
AMD EPYC measured, the embedded default's lone-stream step went from ~37 to ~12 ms in bf16 and from ~65 to ~23 ms
in fp32 (benchmark/bench_cpu_peers.py). A Q4_1 or int8 model's step of at most QUANT_KERNEL_MAX_ROWS decode rows
runs the same layer over the 4-bit codes or int8 rows (decode_layer_q, DEEPINFER_CPU_QUANT_ROW), its values those
of the dequantized weights times the rows (fp32 sums; torch's 4-bit matmul rounds the scales to bf16 first); more
rows take the fused layer over the dequantized bf16 copies.

bf16 may differ in one place, for speed: a one-row input (a lone decode stream) of a dense linear or the dense
head takes the product this CPU runs fastest (DEEPINFER_CPU_BF16_GEMV; models/cpu_row_products.py): F.linear,
oneDNN over a weight copy packed for one row (the same values), or torch's bf16 GEMV (torch.mv), whose sums run in
another order, so bf16 results then differ from the module path's in the last bits (logprobs within bf16's
tolerance: test/e2e/test_cpu_step.py). Every layer's bf16 linears take the lone row as a 1-D vector from the
embedding to the final norm (no select / unsqueeze around each product).
Batch-invariant mode never takes this step.

Aten ops a lone decode stream dispatches (benchmark/profile_cpu_decode.py --count-ops, embedded default):
Q4_1 1,186 (39.5 a layer; was 1,282), bf16 1,190 (was 1,524), fp32 1,121 (was 1,158).

Attention goes through the batch's backend (batch.attention), except a bf16 step on a CPU with AVX512-BF16, whose
attention is the kernels' (CpuStep._attention_fn; the backend still stores the new k/v, the pool's contract is
unchanged).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer_rt.env import get_env
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.kernel_config import KernelConfig, cpu_has_native_bf16
from deepinfer_rt.layers.int8 import WeightOnlyLinear
from deepinfer_rt.layers.methods import UnquantizedLinear
from deepinfer_rt.models.base import CausalLM
from deepinfer_rt.models.llama_gpu_step import GpuRowStep
from deepinfer_rt.models.cpu_row_products import KERNEL_MAX_ROWS, bf16_linear_fn, choose_row_gemv, row_kernels



class ModuleStep:
    """The trunk as modules (the reference path)."""

    def prepare(self, model, batch: ForwardBatch) -> None:
        pass

    def forward(self, model, batch: ForwardBatch) -> torch.Tensor:
        return model.model(batch)

    def compute_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        return CausalLM.compute_logits(model, hidden)


@dataclass
class _Layer:
    layer_id: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    qkv_weight: torch.Tensor  # identity of the weights the list was built from
    takes_row: bool = False  # every layer's linears take a lone row as a 1-D vector (bf16 GEMV): see CpuStep.forward


_WHOLE_QKV_ROWS = 64
"""Steps of at most this many tokens rotate the whole QKV output (v through factors 1 and 0) and split it once;
longer ones rotate q | k alone, where the v heads' extra elementwise work outweighs the ops saved (1K-token
prefill, fp32, one thread: 2.3 against 1.8 ms a layer)."""


@dataclass
class _Rope:
    cos: torch.Tensor  # (T, 1, D)
    sin: torch.Tensor  # (T, 1, D/2): both halves of the table are the same frequencies
    signed_sin: torch.Tensor  # (T, 1, D): -sin | sin, the factors of the half-swapped input
    head_cos: torch.Tensor | None  # (T, Hq + 2 Hkv, D): cos on the q and k heads, 1 on the v heads (T small)
    head_signed_sin: torch.Tensor | None  # (T, Hq + 2 Hkv, D): signed_sin on q and k, 0 on v (T small)

    def rotate(self, qkv: torch.Tensor, heads: tuple[int, int, int]) -> tuple[torch.Tensor, ...]:
        """qkv (T, Hq + 2 Hkv, D) -> q, k rotated and v: x*cos + (x2 | x1)*(-sin | sin) per head."""
        half = qkv.shape[-1] // 2
        if self.head_cos is not None:  # v * 1 + swapped * 0 == v
            return torch.split_with_sizes(qkv * self.head_cos + qkv.roll(half, dims=-1) * self.head_signed_sin,
                                          heads, dim=1)  # Tensor.split's Python wrapper: 3x the op's time
        num_qk = heads[0] + heads[1]
        qk = qkv[:, :num_qk]
        return (*torch.split_with_sizes(qk * self.cos + qk.roll(half, dims=-1) * self.signed_sin, heads[:2], dim=1),
                qkv[:, num_qk:])


@functools.cache
def _rotation_factors(num_qk: int, num_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Constants that turn a step's (T, 1, D) cos / sin into the rotation's factors in one op each, exactly (every
    product is by 1, -1 or 0): sign (D,) = -1 | 1; qk (H, 1) = 1 on q and k heads, 0 on v; v (H, 1) = its
    complement; head_sign (H, D) = sign on q and k heads, 0 on v."""
    half = head_dim // 2
    sign = torch.cat([-torch.ones(half), torch.ones(head_dim - half)]).to(dtype=dtype, device=device)
    qk = torch.cat([torch.ones(num_qk, 1), torch.zeros(num_kv, 1)]).to(dtype=dtype, device=device)
    return sign, qk, 1 - qk, qk * sign


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """reference.rms_norm in fewer ops, bitwise the same on CPU (test/e2e/test_cpu_step.py). fp32: torch's rms_norm.
    16-bit: reference's fp32 steps written out (torch's CPU rms_norm is itself these ops), the fp32 product rounded
    once as it is stored into the 16-bit `out` (a buffer the caller reuses; the cast the reference makes) and then
    scaled by the weight in place: 7 ops where `weight * rms_norm(x.float()).to(dtype)` dispatches 8, no allocation
    for the result."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    inv = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    out = torch.mul(xf, inv, out=x.new_empty(x.shape) if out is None else out)
    return out.mul_(weight)


def _linear_fn(linear: torch.nn.Module, row: str = "linear") -> Callable[[torch.Tensor], torch.Tensor]:
    method = linear.method
    if type(method) is UnquantizedLinear:
        weight, bias = linear.weight, linear.bias
        if weight.dtype == torch.bfloat16 and bias is None:
            return bf16_linear_fn(weight, row)
        if bias is None:  # F.linear's own decomposition (t, mm) with the transpose made once: the same bits
            weight_t = weight.t()
            return lambda x: torch.mm(x, weight_t)
        return lambda x: F.linear(x, weight, bias)
    if isinstance(method, WeightOnlyLinear) and linear.bias is None:  # x is (T, K) in the model dtype here
        packed, apply, max_rows = method.packed_fn(linear), method.apply, method.max_rows
        return lambda x: packed(x) if x.shape[0] <= max_rows else apply(linear, x)
    return functools.partial(method.apply, linear)


FP32_KERNEL_MAX_ROWS = 16
"""The same for fp32 decode rows, whose product in the kernels takes one input row at a time (no AVX512-BF16 pairs
to share a weight load): fp32 decode tok/s against torch's mm, batch 8 99 / 77, 16 127 / 115, 32 128 / 144."""

QUANT_KERNEL_MAX_ROWS = 3
"""A Q4_1 or int8 model's decode step of at most this many rows runs each layer as one kernel call over the 4-bit
codes or int8 rows (deepinfer_cpu::decode_layer_q, DEEPINFER_CPU_QUANT_ROW=kernel); a step of more rows (up to
KERNEL_MAX_ROWS) runs the same fused layer over the linears' dequantized bf16 copies (WeightOnlyLinear.dense_in,
the copies prefill GEMMs use), where expanding the codes again for every row costs more than reading 16-bit
weights. The 30 layers' four products of the embedded default's shapes, bf16, 2-core EPYC, against 16-bit
weights: Q4_1 codes 1 row 3.6 / 7.7 ms, 2 rows 5.4 / 7.1, 4 rows 7.9 / 7.4, 8 rows 15.0 / 9.8; int8 rows 1 row
4.5 / 7.9, 2 rows 4.8 / 8.2, 4 rows 9.2 / 9.0."""

PREFILL_ATTENTION_MIN_ROWS = 16
PREFILL_ATTENTION_MAX_SEQS = 16
"""A bf16 step takes the kernels' attention (CpuStep._attention_fn) when some sequence brings at least
PREFILL_ATTENTION_MIN_ROWS new tokens and the step holds at most PREFILL_ATTENTION_MAX_SEQS sequences: the kernel
packs each sequence's keys and runs it apart, which pays for a prompt's queries but not for a batch of one-token
decode rows (those keep the backend, or the fused decode rows)."""

def _takes_row(linear: torch.nn.Module) -> bool:
    return type(linear.method) is UnquantizedLinear and linear.weight.dtype == torch.bfloat16 and linear.bias is None


def _layer_list(model) -> list[_Layer]:
    """The layers' weights as a flat list. `model.row_product`: how a lone bf16 row is multiplied (ROW_PRODUCTS,
    chosen on gate_up by choose_row_gemv when every layer's linears are 16-bit dense, else F.linear);
    `model.head_fn`: the dense bf16 head's product under that choice (None for any other head)."""
    takes_row = all(_takes_row(lin) for layer in model.model.layers
                    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                layer.mlp.down_proj))
    row = "linear"
    if takes_row and model.model.layers:
        row = choose_row_gemv(model.model.layers[0].mlp.gate_up_proj.weight, get_env().cpu_bf16_gemv)
    model.row_product = row
    head = model.lm_head
    model.head_fn = (bf16_linear_fn(head.weight, row) if head.bias is None and type(model.logits_method)
                     is UnquantizedLinear and head.weight.dtype == torch.bfloat16 else None)
    layers = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        layers.append(_Layer(i, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                             *(_linear_fn(lin, row) for lin in linears), attn.qkv_proj.weight))
        layers[-1].takes_row = takes_row
    model.row_weights = _row_weights(model) if row == "kernel" else None
    model.row_weights_quantized = _quantized_row_weights(model)
    # bf16 steps' attention through the kernels where they build and the CPU has AVX512-BF16 (CpuStep._attention_fn)
    model.attention_ops = (row_kernels() if model.model.embed_tokens.weight.dtype == torch.bfloat16
                           and _cpu_has_avx512_bf16() else None)
    if _fp32_takes_kernel(model):
        model.row_weights = _row_weights(model)
        model.head_fn = _fp32_head_fn(head.weight) if head.bias is None and type(model.logits_method) \
            is UnquantizedLinear else None
    return layers


def _fp32_takes_kernel(model) -> bool:
    """Whether lone fp32 rows run the lone-row kernels (DEEPINFER_CPU_FP32_ROW): every layer's linears dense
    fp32 without bias, and the kernels built."""
    setting = get_env().cpu_fp32_row
    if setting not in ("kernel", "mm"):
        raise ValueError(f"DEEPINFER_CPU_FP32_ROW={setting!r}: not one of kernel, mm")
    dense = model.model.layers and all(
        type(lin.method) is UnquantizedLinear and lin.weight.dtype == torch.float32 and lin.bias is None
        for layer in model.model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj))
    return bool(dense) and setting == "kernel" and row_kernels() is not None


def _fp32_head_fn(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    gemv = row_kernels().gemv
    return lambda x: gemv(x.view(-1), weight, False).view(1, -1) if x.shape[0] == 1 else F.linear(x, weight)


def _row_weights(model) -> list[tuple[torch.Tensor, ...]] | None:
    """Per layer (input norm, post norm, qkv, o, gate_up, down) for the fused lone-row layer
    (deepinfer_cpu::decode_layer), or None where a weight is not a contiguous tensor of the embedding's dtype
    (bf16 or fp32: the kernel takes one dtype throughout)."""
    out = []
    dtype = model.model.embed_tokens.weight.dtype
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.qkv_proj.weight,
                   attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        if dtype not in (torch.bfloat16, torch.float32) or not all(w.dtype == dtype and w.is_contiguous()
                                                                   for w in weights):
            return None
        out.append(weights)
    return out


def _quantized_linears(model) -> list[tuple[torch.nn.Module, ...]] | None:
    """Per layer (qkv, o, gate_up, down) where every one is a Q4_1 linear without bias, or every one an int8 linear
    without bias; else None."""
    from deepinfer_rt.layers.int8 import Int8WeightOnlyLinear
    from deepinfer_rt.layers.q4 import Q4WeightOnlyLinear

    out, kinds = [], set()
    for layer in model.model.layers:
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        kinds.update(type(lin.method) for lin in linears)
        if any(lin.bias is not None for lin in linears):
            return None
        out.append(linears)
    return out if kinds in ({Q4WeightOnlyLinear}, {Int8WeightOnlyLinear}) else None


def _quantized_row_weights(model) -> list[tuple] | None:
    """Per layer (input norm, post norm, then qkv, o, gate_up, down each as [codes, d, c] (Q4_1:
    layers/q4.kernel_rows) or [q, scale] (int8)) for deepinfer_cpu::decode_layer_q, or None: the linears not all
    Q4_1 or all int8, DEEPINFER_CPU_QUANT_ROW=torch, a CPU without native bf16 (where the kernels' portable loops
    are not known to beat torch's packed matmuls), the kernels not built, or the model dtype neither bf16 nor fp32."""
    setting = get_env().cpu_quant_row
    if setting not in ("kernel", "torch"):
        raise ValueError(f"DEEPINFER_CPU_QUANT_ROW={setting!r}: not one of kernel, torch")
    linears = _quantized_linears(model)
    dtype = model.model.embed_tokens.weight.dtype
    if linears is None or setting != "kernel" or dtype not in (torch.bfloat16, torch.float32) \
            or not cpu_has_native_bf16() or row_kernels() is None:
        return None
    return [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
             *(list(getattr(lin, "q4_rows", None) or lin.int8_rows) for lin in lins))
            for layer, lins in zip(model.model.layers, linears)]


def _dequantized_row_weights(model) -> list[tuple[torch.Tensor, ...]]:
    """A Q4_1 or int8 model's layers for deepinfer_cpu::decode_layer over its linears' dequantized copies in the
    model dtype (made once and kept, WeightOnlyLinear.dense_in; the copies prefill already makes), or [] where those
    copies are not kept (DEEPINFER_CPU_DENSE_COPY=0)."""
    if not get_env().cpu_dense_copy:
        return []
    dtype = model.model.embed_tokens.weight.dtype
    return [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
             *(lin.method.dense_in(lin, dtype) for lin in lins))
            for layer, lins in zip(model.model.layers, _quantized_linears(model))]


def _cpu_has_avx512_bf16() -> bool:
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    if probe is not None:
        return bool(probe())
    try:
        return " avx512_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def _row_kernel_fits(batch: ForwardBatch, dtype: torch.dtype) -> bool:
    """Whether a lone row's layers may run as one kernel call each: the reference backend's pool of K/V rows
    (S, Hkv, D) in the model's dtype, which the kernel writes and reads itself."""
    pool = batch.pool
    return (getattr(batch.backend, "name", None) == "torch" and not pool.is_fp8
            and all(k.dtype == dtype and k.dim() == 3 for k in pool.k)
            and all(v.dtype == dtype and v.dim() == 3 for v in pool.v))


class CpuStep(ModuleStep):
    def compute_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        head, method = model.lm_head, model.logits_method
        head_fn = getattr(model, "head_fn", None)
        if head_fn is not None:  # the dense bf16 head, under the layers' lone-row product (_layer_list)
            return head_fn(hidden).float()
        if head.bias is None and isinstance(method, WeightOnlyLinear) and hidden.shape[0] <= method.max_rows:
            return method.packed_fn(head)(hidden).float()
        return super().compute_logits(model, hidden)

    def prepare(self, model, batch: ForwardBatch) -> None:
        config = model.config
        rope = model.model.layers[0].self_attn.rotary_emb
        cos, sin = rope.cos_sin(batch.positions, model.model.embed_tokens.weight.dtype)
        t, half = cos.shape[0], cos.shape[-1] // 2
        cos, sin = cos[:, None, :], sin[:, None, :]
        num_qk, num_kv = config.num_heads + config.num_kv_heads, config.num_kv_heads
        sign, qk, v, head_sign = _rotation_factors(num_qk, num_kv, cos.shape[-1], cos.dtype, cos.device)
        signed_sin = sin * sign
        head_cos = head_signed_sin = None
        if t <= _WHOLE_QKV_ROWS:  # cos on q and k heads, 1 on v; -sin | sin on q and k, 0 on v
            head_cos, head_signed_sin = torch.addcmul(v, cos, qk), sin * head_sign
        batch.model_meta = _Rope(cos, sin[..., :half].contiguous(), signed_sin, head_cos, head_signed_sin)

    def forward(self, model, batch: ForwardBatch) -> torch.Tensor:
        trunk, config = model.model, model.config
        layers = model.fast_layers
        if not layers or layers[0].qkv_weight is not trunk.layers[0].self_attn.qkv_proj.weight:
            layers = model.fast_layers = _layer_list(model)
        rope: _Rope = batch.model_meta
        eps, scale = config.rms_norm_eps, config.head_dim**-0.5
        num_q, num_kv, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        inter = config.intermediate_size
        heads, num_heads = (num_q, num_kv, num_kv), num_q + 2 * num_kv
        x = F.embedding(batch.input_ids, trunk.embed_tokens.weight)
        t = x.shape[0]
        as_row = t == 1 and layers[0].takes_row
        most = KERNEL_MAX_ROWS if x.dtype == torch.bfloat16 else FP32_KERNEL_MAX_ROWS
        if t <= most and t == len(batch.q_lens) and _row_kernel_fits(batch, x.dtype):  # decode rows only
            quantized = model.row_weights_quantized
            if quantized is not None and t <= QUANT_KERNEL_MAX_ROWS:
                return self._row_forward(model, batch, x, quantized, row_kernels().decode_layer_q)
            if quantized is not None and model.row_weights is None:
                model.row_weights = _dequantized_row_weights(model)
            if model.row_weights:
                return self._row_forward(model, batch, x, model.row_weights, row_kernels().decode_layer)
        attend = self._attention_fn(model, batch, x.dtype)
        if as_row:  # a lone row stays 1-D through the layers (mv takes it as it is)
            x = x.view(-1)
        shape = x.shape
        # Every 16-bit norm's output: read by the next linear before the next norm writes it
        normed = None if x.dtype == torch.float32 else x.new_empty(shape)
        residual = None
        for layer in layers:
            residual = x if residual is None else x.add_(residual)  # x: the last layer's down output, fresh
            qkv = layer.qkv(_rms_norm(residual, layer.input_norm, eps, normed)).view(t, num_heads, head_dim)
            q, k, v = rope.rotate(qkv, heads)
            o = attend(q, k, v, layer.layer_id, scale)
            residual = layer.o(o.reshape(shape[:-1] + (-1,))).add_(residual)
            gate, up = torch.split_with_sizes(layer.gate_up(_rms_norm(residual, layer.post_norm, eps, normed)),
                                              (inter, inter), dim=-1)
            x = layer.down(torch.mul(F.silu(gate, inplace=True), up))
        hidden = _rms_norm(x.add_(residual), trunk.norm.weight, eps)
        return hidden.view(1, -1) if as_row else hidden


    @staticmethod
    def _attention_fn(model, batch: ForwardBatch, dtype: torch.dtype) -> Callable:
        """The step's attention: the batch's backend, or for bf16 on a CPU with AVX512-BF16 (head size 64 or 128,
        the reference backend's bf16 pool) the kernels' causal attention over each sequence's slots
        (deepinfer_cpu::prefill_attention, after the backend stores the new k/v). Its sums run in another order
        than SDPA's (values within bf16's rounding, test/unit/test_cpu_row_kernels.py); 1K-token prompt on the
        embedded default's heads, 2-core EPYC: 6.2 against SDPA's 11.6 ms a layer, 4K: 93 against 140."""
        ops = model.attention_ops
        if (ops is None or dtype != torch.bfloat16 or model.config.head_dim not in (64, 128)
                or len(batch.q_lens) > PREFILL_ATTENTION_MAX_SEQS or max(batch.q_lens) < PREFILL_ATTENTION_MIN_ROWS
                or not _row_kernel_fits(batch, dtype)):
            return batch.attention
        n = len(batch.q_lens)
        slots = torch.cat([batch.kv_slots[i] for i in range(n)]) if n > 1 else batch.kv_slots[0].contiguous()
        starts = torch.tensor([0, *itertools.accumulate(batch.kv_lens)])
        q_lens = torch.tensor(batch.q_lens)
        pool, store = batch.pool, batch.backend.store_kv

        def attend(q, k, v, layer_id: int, scale: float) -> torch.Tensor:
            store(batch, layer_id, k, v)
            return ops.prefill_attention(q, pool.k[layer_id], pool.v[layer_id], slots, starts, q_lens, scale)
        return attend

    @staticmethod
    def _row_forward(model, batch: ForwardBatch, x: torch.Tensor, layer_weights: list[tuple],
                     decode_layer: Callable) -> torch.Tensor:
        """Decode rows (bf16 or fp32; every sequence one new token, at most KERNEL_MAX_ROWS of them) through one
        kernel call per layer (deepinfer_cpu::decode_layer, or decode_layer_q over quantized weights: norms, products,
        rotary, the K/V writes and each row's attention over its sequence's slots), then the final norm. x (B, H)."""
        config, pool, rope = model.config, batch.pool, batch.model_meta
        rows = x.shape[0]
        cos, signed_sin = rope.cos.reshape(rows, -1), rope.signed_sin.reshape(rows, -1)
        if rows == 1:
            slots = batch.kv_slots[0].contiguous()
            starts = torch.tensor([0, slots.shape[0]])
        else:
            slots = torch.cat([batch.kv_slots[i] for i in range(rows)])
            starts = torch.tensor([0, *itertools.accumulate(batch.kv_lens)])
        eps, scale, num_q, num_kv = config.rms_norm_eps, config.head_dim**-0.5, config.num_heads, config.num_kv_heads
        residual = torch.empty_like(x)
        for i, weights in enumerate(layer_weights):
            decode_layer(x, residual, i == 0, *weights, cos, signed_sin, pool.k[i], pool.v[i], slots, starts,
                         batch.out_slots, num_q, num_kv, eps, scale)
        return _rms_norm(x.add_(residual), model.model.norm.weight, eps)


@functools.cache
def llama_step_method(config: KernelConfig) -> "ModuleStep | GpuRowStep":
    if (config.device_type == "cpu" and config.is_cpu_fast_step and not config.is_batch_invariant
            and config.quantization in (None, "int8", "q4_1")):
        if config.is_cpu_compile and config.quantization is None:
            from deepinfer_rt.models.llama_compiled import CompiledCpuStep

            return CompiledCpuStep(CpuStep())
        return CpuStep()
    if config.is_triton and config.is_gpu_row_step and not config.is_batch_invariant and config.quantization is None:
        return GpuRowStep(pdl=config.uses_pdl)
    return ModuleStep()
