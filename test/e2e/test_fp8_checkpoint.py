"""DeepSeek-V3/R1 release checkpoints (FP8 e4m3, 128 x 128 float32 `weight_scale_inv`) on CPU, fp32.

A tiny random DeepSeek-V3 whose dims span several 128-blocks and end inside one (hidden 256, dense intermediate
384, experts 192, q_lora 192 so that fused_qkv_a's kv_a shard starts mid-block, kv_lora 160) is saved in bf16,
written in the release format by scripts/quantize_checkpoint.py and loaded by the engine, which dequantizes
it at load (fp8 value x block scale in fp32). The reference is transformers on the same dequantized weights
(a plain fp32 checkpoint), and transformers' own fine-grained FP8 integration on the release folder.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import checkpoint_folder, hf_greedy
from safetensors.torch import load_file
from test_deepseek_v3 import assert_logits_close, encode, hf_logits, new_pool, step

from deepinfer_kernels.reference import dequantize_fp8_blocks
from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.config import QuantConfig
from deepinfer_rt.models.loader import build_model, load_model_config

CPU = torch.device("cpu")
DIMS = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=192, q_lora_rank=192, kv_lora_rank=160)
PROMPTS = ["Hello", "The capital of France is", "def f(x):\n    return", "1 2 3 4 5 6 7 8 9 10 11 12"]
HF_FP8_ATOL = 1e-4
"""transformers' FP8 integration on CPU (no GPU: it dequantizes at load) against our dequantized load."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(bf16 folder, release-format FP8 folder, fp32 folder of the FP8 folder's dequantized weights)."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8")
    fp32 = make_tiny_checkpoint("deepseek_v3", root / "fp32", seed=0, **DIMS)
    config = json.loads((fp32 / "config.json").read_text())
    bf16 = checkpoint_folder(fp32, root / "bf16", {n: t.to(torch.bfloat16) for n, t in
                                                   load_file(fp32 / "model.safetensors").items()},
                             dict(config, dtype="bfloat16"))
    fp8 = quantize_checkpoint(bf16, root / "fp8", "v3-fp8")
    tensors = load_file(fp8 / "model.safetensors")
    dequant = {n: (dequantize_fp8_blocks(t, tensors[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn
                   else t.float()) for n, t in tensors.items() if not n.endswith("_scale_inv")}
    ref = checkpoint_folder(fp32, root / "dequant", dequant, dict(config, dtype="float32"))
    return bf16, fp8, ref


def test_release_format_as_written(ckpts):
    _, fp8, _ = ckpts
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    t = load_file(fp8 / "model.safetensors")
    attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert t[f"{attn}.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert t[f"{attn}.q_a_proj.weight_scale_inv"].shape == (2, 2)  # 192 x 256
    assert t[f"{attn}.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)  # 168 x 256
    assert t[f"{mlp}.down_proj.weight_scale_inv"].shape == (2, 3)  # 256 x 384
    assert t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"].shape == (2, 2)  # 192 x 256
    assert t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"].dtype == torch.float32
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 f"{attn}.kv_a_layernorm.weight"):
        assert t[name].dtype == torch.bfloat16, name
        assert name + "_scale_inv" not in t
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


@pytest.fixture(scope="module")
def models(ckpts):
    from transformers import AutoModelForCausalLM

    _, fp8, ref_path = ckpts
    config, _ = load_model_config(fp8)
    assert config.quantization == QuantConfig("fp8", (128, 128))
    model = build_model(config, fp8, "auto", torch.float32, CPU, seed=0)
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    return config, model, ref


@torch.no_grad()
def test_loads_the_dequantized_weights_exactly(ckpts, models):
    _, model, ref = models
    layer, ref_layer = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
    want = torch.cat([ref_layer.q_a_proj.weight, ref_layer.kv_a_proj_with_mqa.weight])
    assert torch.equal(layer.fused_qkv_a_proj.weight, want)
    assert torch.equal(layer.kv_b_proj.weight, ref_layer.kv_b_proj.weight)
    experts, ref_experts = model.model.layers[1].mlp.experts, ref.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj, ref_experts.gate_up_proj)
    assert torch.equal(experts.down_proj, ref_experts.down_proj)
    assert not [n for n, _ in model.named_parameters() if n.endswith("_scale_inv")]  # dropped once applied


def test_prefill_logits_match_transformers_on_dequantized_weights(models):
    from transformers import AutoTokenizer

    config, model, ref = models
    tok = AutoTokenizer.from_pretrained(ref.name_or_path)
    pool = new_pool(model, config)
    for text in PROMPTS:
        p = encode(tok, text)
        (got,) = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p))])
        assert_logits_close(got, hf_logits(ref, p))


def test_engine_greedy_matches_transformers(ckpts, models):
    _, fp8, _ = ckpts
    _, _, ref = models
    with Engine(str(fp8), dtype="float32", kv_cache_tokens=2048) as engine:
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        with torch.no_grad():
            expected = [hf_greedy(ref, x, 10, engine.eos_ids) for x in ids]
        outs = engine.generate(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=10, temperature=0))
        assert [o.token_ids for o in outs] == expected


ALIGNED_DIMS = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=256,
                    kv_lora_rank=120, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=8)
"""Every weight dim a multiple of 128 or below it: transformers' CPU dequantization derives the block size from
the scale grid (rows // scale rows), which is only right for such shapes (192 rows in 2 blocks would be read as
blocks of 96)."""


@torch.no_grad()
def test_matches_transformers_fp8_integration(tmp_path):
    """transformers loads the release folder itself (without a GPU its fine-grained FP8 integration dequantizes
    at load); our load of the same folder gives the same logits."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import quantize_checkpoint
    from transformers import AutoModelForCausalLM

    src = make_tiny_checkpoint("deepseek_v3", tmp_path / "src", seed=2, num_hidden_layers=2, **ALIGNED_DIMS)
    fp8 = quantize_checkpoint(src, tmp_path / "fp8", "v3-fp8")
    hf_fp8 = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32).eval()
    config, _ = load_model_config(fp8)
    model = build_model(config, fp8, "auto", torch.float32, CPU, seed=0)
    p = list(range(1, 20))
    pool = new_pool(model, config)
    (got,) = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p))])
    err = (got - hf_logits(hf_fp8, p)).abs().max().item()
    assert err <= HF_FP8_ATOL, err


def test_online_quantization_equals_the_quantized_checkpoint(ckpts, models):
    """Engine(quantization="fp8") on the bf16 folder quantizes at load (CPU: then dequantizes) to the very
    weights scripts/quantize_checkpoint.py wrote; the greedy tokens are the same."""
    bf16, fp8, _ = ckpts
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with Engine(str(bf16), dtype="float32", kv_cache_tokens=1024, quantization="fp8") as online:
        online_weights = dict(online.model.named_parameters())
        outs = [o.token_ids for o in online.generate(PROMPTS, sampling_params=sp)]
    _, offline, _ = models
    for name, p in offline.named_parameters():
        assert torch.equal(p, online_weights[name]), name
    with Engine(str(fp8), dtype="float32", kv_cache_tokens=1024) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, sampling_params=sp)] == outs
    with pytest.raises(ValueError, match="quantization"):
        Engine(str(bf16), dtype="float32", quantization="int4")


@torch.no_grad()
def test_dummy_weights_from_an_fp8_config(ckpts):
    _, fp8, _ = ckpts
    config, _ = load_model_config(fp8)
    model = build_model(config, None, "dummy", torch.float32, CPU, seed=0)
    w = model.model.layers[0].mlp.down_proj.weight
    assert 0.01 < w.std().item() < 0.03  # normal(0, 1) fp8 values x 0.02 block scales
    p = list(range(1, 9))
    pool = new_pool(model, config)
    (logits,) = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p))])
    assert logits.isfinite().all()


def _with_tensor(fp8: Path, dst: Path, name: str, tensor: torch.Tensor) -> Path:
    tensors = load_file(fp8 / "model.safetensors")
    tensors[name] = tensor
    return checkpoint_folder(fp8, dst, tensors, json.loads((fp8 / "config.json").read_text()))


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv",
                                  "model.layers.0.mlp.up_proj.weight_scale_inv",
                                  "model.layers.0.self_attn.o_proj.weight_scale_inv",
                                  "model.layers.1.mlp.experts.gate_up_proj_scale_inv"])
def test_scale_shape_mismatch_names_the_tensor(ckpts, tmp_path, name):
    _, fp8, _ = ckpts
    if ".experts." in name:  # every expert's scale one block row short: the fused tensor is refused
        tensors = load_file(fp8 / "model.safetensors")
        for key in [k for k in tensors if k.startswith("model.layers.1.mlp.experts.") and "up_proj.weight_scale" in k]:
            tensors[key] = tensors[key][:1]
        path = checkpoint_folder(fp8, tmp_path / "bad", tensors, json.loads((fp8 / "config.json").read_text()))
    else:
        path = _with_tensor(fp8, tmp_path / "bad", name, torch.ones(3, 5))
    config, _ = load_model_config(path)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        build_model(config, path, "auto", torch.float32, CPU, seed=0)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_proj.weight"])
def test_unquantized_weight_in_an_fp8_checkpoint_names_the_tensor(ckpts, tmp_path, name):
    _, fp8, _ = ckpts
    weight = load_file(fp8 / "model.safetensors")[name]
    path = _with_tensor(fp8, tmp_path / "bad", name, weight.to(torch.bfloat16))
    config, _ = load_model_config(path)
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*float8"):
        build_model(config, path, "auto", torch.float32, CPU, seed=0)


@pytest.mark.parametrize("field,value", [("quant_method", "awq"), ("fmt", "e5m2"), ("weight_block_size", [128]),
                                         ("activation_scheme", "static")])
def test_unknown_quantization_config_names_the_field(ckpts, tmp_path, field, value):
    _, fp8, _ = ckpts
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"][field] = value
    dst = tmp_path / "bad"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"quantization_config.{field}"):
        load_model_config(dst)
