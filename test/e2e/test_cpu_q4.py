"""Weight-only Q4_1 (Engine(quantization="q4_1"), layers/q4.py): the quantizer follows GGUF's Q4_1 rule, so on the
embedded default it gives back the shipped file's 4-bit codes, scales and minimums for every Q4_1 tensor; the
engine with Q4_1 linears agrees with the dense model whose weights are those blocks dequantized."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer_rt import Engine
from deepinfer_rt.layers.q4 import Q4WeightOnlyLinear, dequantize_q4_1, dequantized, quantize_q4_1

from helpers import check_weight_only_matches_dense


def test_quantize_q4_1_round_trip():
    w = torch.randn(8, 96)
    w[0, :32] = 0.25  # a constant block: d = 0, every code 0
    codes, d, m = quantize_q4_1(w)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    back = dequantize_q4_1(codes, d, m)
    assert torch.equal(back[0, :32], torch.full((32,), 0.25))
    assert (back - w).abs().max() <= d.float().max() / 2 + 1e-3
    assert torch.equal(quantize_q4_1(back)[0], codes)  # quantizing the dequantized weight is a fixed point
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_1(torch.randn(4, 40))


def _gguf_q4_1_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_1 tensor's raw bytes -> (codes (N, K), d (N, K/32), m (N, K/32)); a block is fp16 d, fp16 m, then
    16 bytes whose low nibbles are weights 0..15 and high nibbles weights 16..31."""
    raw = np.asarray(tensor.data, dtype=np.uint8)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return codes, d, m


def test_q4_1_reproduces_the_shipped_gguf_blocks():
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from deepinfer_rt.models.smollm2 import ensure_smollm2, gguf_path

    try:
        path = ensure_smollm2()
    except RuntimeError as e:
        pytest.skip(str(e))
    weights = load_file(path / "model.safetensors")
    cfg = AutoConfig.from_pretrained(path)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    checked = 0
    for tensor in gguf.GGUFReader(str(gguf_path())).tensors:
        if tensor.tensor_type.name != "Q4_1":
            continue
        _, layer, kind, _ = tensor.name.split(".")
        w = weights[f"model.layers.{layer}.{names[kind]}.weight"]
        if kind in ("attn_q", "attn_k"):  # the GGUF keeps q/k rows in the interleaved-rope order
            heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
        codes, d, m = quantize_q4_1(w)
        want_codes, want_d, want_m = _gguf_q4_1_blocks(tensor)
        assert np.array_equal(codes.numpy(), want_codes), tensor.name
        assert np.array_equal(d.numpy(), want_d) and np.array_equal(m.numpy(), want_m), tensor.name
        checked += 1
    assert checked == 210  # 30 layers x 7 linears


def test_q4_1_refused_where_it_does_not_run(tiny_llama_path):
    with pytest.raises(ValueError, match="q4_1"):
        Engine(str(tiny_llama_path), dtype="float32", kv_cache_tokens=256, quantization="q4_1", batch_invariant=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_q4_1_matches_dequantized_reference(tiny_llama_path, dtype):
    check_weight_only_matches_dense(tiny_llama_path, dtype, "q4_1", Q4WeightOnlyLinear, dequantized)


@pytest.mark.parametrize("keep", ["1", "0"])
def test_dense_copy_kept_once_made(monkeypatch, keep):
    """More than Q4_MM_MAX_ROWS rows multiply by the dequantized weight: kept on the layer after the first such call
    (DEEPINFER_CPU_DENSE_COPY, default on), made again for each call when off; the same values either way, and
    a few rows never make it."""
    from torch import nn

    from deepinfer_rt.layers.q4 import Q4_MM_MAX_ROWS

    monkeypatch.setenv("DEEPINFER_CPU_DENSE_COPY", keep)
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=False)
    method = Q4WeightOnlyLinear()
    method.process_weights_after_loading(layer)
    few = method.apply(layer, torch.randn(Q4_MM_MAX_ROWS, 64))
    assert few.shape == (Q4_MM_MAX_ROWS, 96) and getattr(layer, "dense_copy", None) is None
    x = torch.randn(Q4_MM_MAX_ROWS + 4, 64)
    first, second = method.apply(layer, x), method.apply(layer, x)
    assert torch.equal(first, torch.nn.functional.linear(x, dequantized(layer))) and torch.equal(first, second)
    assert (getattr(layer, "dense_copy", None) is not None) == (keep == "1")


@pytest.mark.parametrize("quantization", ["q4_1", "int8"])
def test_packed_fn_equals_packed_mm(tiny_llama_path, quantization):
    """The CPU step's bound matmul (WeightOnlyLinear.packed_fn, scales already in the model dtype) computes what the
    method's packed_mm does, bit for bit, for the linears and the int8 head."""
    from deepinfer_rt.layers.int8 import WeightOnlyLinear

    with Engine(str(tiny_llama_path), dtype="bfloat16", kv_cache_tokens=256, quantization=quantization) as engine:
        model = engine.model
        layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), WeightOnlyLinear)]
        pairs = [(m, m.method) for m in layers] + [(model.lm_head, model.logits_method)]
        assert len(pairs) > 2
        g = torch.Generator().manual_seed(0)
        for layer, method in pairs:
            k = layer.in_features
            for rows in (1, 3):
                x = torch.randn(rows, k, generator=g).bfloat16()
                assert torch.equal(method.packed_fn(layer)(x), method.packed_mm(layer, x))

