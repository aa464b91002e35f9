"""The Llama trunk on CUDA for steps of a few tokens (decode at small batch): six launches a layer instead of ten.

A small model's decode step at batch 1 is bound by how many kernels run one after another, not by the bytes they
read (SmolLM2 at 32K on an H100: 30 layers x 10 launches of 1-4 us each around a 10 us attention; the floor is 0.34
ms a step). Here each layer runs

    norm(x + r) @ qkv.T, rotary, K/V store    one launch (deepinfer_kernels.row_gemv.qkv_rope_store: the residual
                                              add and RMSNorm before the product, q and k rotated, k and v stored)
    attention                    the backend's decode kernels (split over keys, then the merge)
    o @ o_proj.T                 one launch
    silu(norm(o + r) @ gate.T) * (norm(o + r) @ up.T)    one launch
    @ down.T                     one launch; its residual add goes to the next layer's first launch

where the module path (ModuleStep) runs the add + norm, each product through cuBLAS, the rotary + store and SiLU-and-mul
apart. Where the backend does not take the one-launch store (an FP8 KV pool) or the heads are not a power of two,
the QKV product is row_gemv's and LlamaAttention.attend rotates, stores and attends as the module path does. Steps of
more than row_gemv.MAX_ROWS tokens (prefill chunks, larger batches) take the module path, whose cuBLAS GEMMs
are the faster there. Values: the same operations and roundings as the module path, the products' sums in
another order (fp32 accumulation), so logits agree within the last bits (test/gpu/test_gpu_row_step.py).

Chosen at build (models/llama_step.llama_step_method): CUDA with Triton, not batch-invariant (its products do not keep a fixed
reduction order across batch sizes' paths), unquantized weights; DEEPINFER_GPU_ROW_STEP=0 turns it off. At the
first step the model's layers are checked (hidden size up to ROW_STEP_MAX_HIDDEN, dense 16/32-bit linears without
bias, contiguous, one dtype); a model that does not qualify keeps the module path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers.methods import GatedMLPMethod, UnquantizedLinear
from deepinfer_rt.models.base import CausalLM


@dataclass
class _RowLayer:
    attn: torch.nn.Module
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class GpuRowStep:
    """See the module doc. The step-method contract of models/llama_step.py (prepare, forward, compute_logits)."""

    def __init__(self, pdl: bool = False):
        self.pdl = pdl
        """The products as programmatic dependent launches (DEEPINFER_GPU_PDL on an SM90+ GPU)."""

    def prepare(self, model, batch: ForwardBatch) -> None:
        pass

    def compute_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        return CausalLM.compute_logits(model, hidden)

    def forward(self, model, batch: ForwardBatch) -> torch.Tensor:
        from deepinfer_kernels.row_gemv import MAX_ROWS, row_gemv

        layers = self._layers(model)
        if layers is None or batch.input_ids.shape[0] > MAX_ROWS:
            return model.model(batch)
        eps = model.config.rms_norm_eps
        pdl = self.pdl
        x, residual = model.model.embed_tokens(batch.input_ids), None
        for layer in layers:
            if layer.attn.is_rope_store_fused(batch):
                q, residual = self._qkv_rope_store(layer, x, residual, batch, eps, pdl)
                attended = layer.attn.attend_stored(q, batch)
            else:
                if residual is None:
                    qkv, residual = row_gemv(x, layer.qkv, norm_weight=layer.input_norm, eps=eps, pdl=pdl), x
                else:
                    qkv, residual = row_gemv(x, layer.qkv, residual=residual, norm_weight=layer.input_norm, eps=eps,
                                             pdl=pdl)
                attended = layer.attn.attend(qkv, batch)
            o = row_gemv(attended, layer.o, pdl=pdl)
            h, residual = row_gemv(o, layer.gate_up, residual=residual, norm_weight=layer.post_norm, eps=eps,
                                   silu_mul=True, pdl=pdl)
            x = row_gemv(h, layer.down, pdl=pdl)
        return model.model.norm.forward_add(x, residual)[0]

    @staticmethod
    def _qkv_rope_store(layer: _RowLayer, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                        eps: float, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(rotated q, residual) with the step's K / V stored: add + norm + QKV + rotary + store in one launch."""
        from deepinfer_kernels.row_gemv import qkv_rope_store

        attn = layer.attn
        cos, sin = attn.rotary_emb.tables(x.device)
        args = (x, layer.qkv, attn.num_heads, attn.num_kv_heads, batch.positions, cos, sin, attn.rotary_emb.interleave,
                batch.pool.k[attn.layer_id], batch.pool.v[attn.layer_id], batch.out_slots)
        if residual is None:
            return qkv_rope_store(*args, norm_weight=layer.input_norm, eps=eps, pdl=pdl), x
        return qkv_rope_store(*args, residual=residual, norm_weight=layer.input_norm, eps=eps, pdl=pdl)

    @staticmethod
    def _layers(model) -> list[_RowLayer] | None:
        """The layers' weights, rebuilt when they were replaced; None where a layer does not qualify."""
        cached = getattr(model, "gpu_row_layers", None)
        first = model.model.layers[0] if len(model.model.layers) else None
        if cached is not None and (cached == [] or cached[0].qkv is first.self_attn.qkv_proj.weight):
            return cached or None
        model.gpu_row_layers = _row_layers(model)
        return model.gpu_row_layers or None


ROW_STEP_MAX_HIDDEN = 1024
"""Widest model the row step takes. Its tiles were measured at SmolLM2's 576 (benchmark/bench_row_gemv.py); wider
models (Llama-1B's 2048 and up, where cuBLAS reads the larger weights near the copy rate) keep the module path until
measured."""


def _row_layers(model) -> list[_RowLayer]:
    dtype = model.model.embed_tokens.weight.dtype
    if model.config.hidden_size > ROW_STEP_MAX_HIDDEN:
        return []
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if (dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or type(mlp.method) is not GatedMLPMethod  # SiLU-and-mul between the products
                or not all(isinstance(lin.method, UnquantizedLinear) and lin.bias is None and lin.weight.dtype == dtype
                           and lin.weight.is_contiguous() for lin in linears)
                or not all(w.dtype == dtype for w in norms)):
            return []
        out.append(_RowLayer(attn, *norms, *(lin.weight for lin in linears)))
    return out
