"""Quantized weights and the FP8 KV cache in the EP worker pool (CPU, gloo): Engine(quantization=...,
kv_cache_dtype=...) reaches every worker, which builds its model and KV pool with them, and release-format
checkpoints (scripts/quantize_checkpoint.py) load in the workers with their experts sharded. EP=2 (data-parallel
attention, the MoE layers' all-to-all) gives the in-process engine's greedy tokens with the same options."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer_rt import Engine, SamplingParams

PROMPTS = [[5, 17, 300, 9, 17, 300, 9, 44, 81, 2000], [100, 200, 300, 400, 100, 200, 7, 8],
           list(range(1000, 1030)), [42, 43, 44, 45, 46]]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)


def _tokens(path, **kwargs) -> list[list[int]]:
    with Engine(str(path), dtype="float32", page_size=4, kv_cache_tokens=1024, **kwargs) as engine:
        return [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    """Tiny DeepSeek-V3 whose linears suit Q4_1 (input widths in 32-weight groups, outputs in 16s)."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ep-q"), seed=0, q_lora_rank=64,
                                qk_rope_head_dim=16)


@pytest.mark.parametrize("options", [dict(quantization="int8"), dict(quantization="q4_1", kv_cache_dtype="fp8_e4m3")],
                         ids=["int8", "q4_1+fp8-kv"])
def test_ep2_with_options_equals_in_process(v3_path, options):
    expected = _tokens(v3_path, **options)
    assert _tokens(v3_path, ep_size=2, **options) == expected


def test_worker_refusal_reaches_the_caller_before_any_worker_starts(tiny_v3_path):
    with pytest.raises(ValueError, match="quantization='q4_1'.*runs on CPU and not in batch-invariant mode"):
        Engine(str(tiny_v3_path), dtype="float32", ep_size=2, quantization="q4_1", batch_invariant=True)
    with pytest.raises(ValueError, match="quantization must be one of"):
        Engine(str(tiny_v3_path), dtype="float32", ep_size=2, quantization="int4")


@pytest.fixture(scope="module")
def v3_fp8_path(tiny_v3_path, tmp_path_factory):
    """The tiny V3 in the DeepSeek-V3 release format (FP8 e4m3, 128 x 128 float32 block scales)."""
    from quantize_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("ep-fp8")
    bf16 = root / "bf16"
    bf16.mkdir()
    for f in tiny_v3_path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (bf16 / f.name).write_bytes(f.read_bytes())
    tensors = {n: t.to(torch.bfloat16) for n, t in load_file(tiny_v3_path / "model.safetensors").items()}
    save_file(tensors, bf16 / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    (bf16 / "config.json").write_text(json.dumps(dict(config, dtype="bfloat16")))
    return quantize_checkpoint(bf16, root / "fp8", "v3-fp8")


def test_ep2_loads_a_v3_fp8_release_checkpoint(v3_fp8_path):
    expected = _tokens(v3_fp8_path)
    assert _tokens(v3_fp8_path, ep_size=2) == expected


@pytest.mark.parametrize("kind, fmt, dims", [
    ("deepseek_v4", "v4", dict(hidden_size=192, q_lora_rank=160, moe_intermediate_size=64, vocab_size=20480)),
    ("deepseek_v41", "v41", dict(hidden_size=96, moe_intermediate_size=64, q_lora_rank=48, engram_head_dim=32))],
    ids=["v4", "v41"])
def test_ep2_loads_mxfp4_release_checkpoints(tmp_path, kind, fmt, dims):
    """DeepSeek-V4 (FP8 with e8m0 128 x 128 scales) and V4.1 (e8m0 32 x 32) releases: MXFP4 routed experts
    (int8 e2m1 pairs, e8m0 per 32) whose packed codes and scales each rank cuts to its own experts."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import quantize_checkpoint

    src = make_tiny_checkpoint(kind, tmp_path / "src", seed=0, **dims)
    path = quantize_checkpoint(src, tmp_path / fmt, fmt, torch.bfloat16)
    expected = _tokens(path)
    assert _tokens(path, ep_size=2) == expected
