"""DeepSeek-V4 / V4-Flash release checkpoints (FP8 e4m3 with e8m0 128 x 128 block scales, MXFP4 routed experts,
the release's tensor names) on CPU, fp32.

A tiny random DeepSeek-V4 (transformers' config, seed 0) whose dims span several blocks and end inside one
(hidden 192 = 1.5 blocks of 128 and 6 MXFP4 groups of 32, q_lora 160, expert width 64 = 2 groups) is saved in
fp32, written in the V4 release format by scripts/quantize_checkpoint.py --format v4 and loaded by the engine,
which decodes the e8m0 scales and dequantizes at load. The references run on the same weights dequantized
(value x 2^e in fp32, a plain fp32 checkpoint under the HF names): our engine token for token, transformers
by logits; and transformers' own FP8 integration on a release folder with block-aligned dims. Format mismatches
are refused naming the tensor.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_deepseek_v4 import hf_logits, new_pool, prompt, step

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.config import QuantConfig
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
from deepinfer_rt.models.loader import build_model, load_model_config
from deepinfer_rt.models.registry import get_model_class
from helpers import checkpoint_folder

CPU = torch.device("cpu")
DIMS = dict(hidden_size=192, q_lora_rank=160, moe_intermediate_size=64, vocab_size=20480)
"""vocab_size below the tokenizer's (the prompts are token ids under 20000): a smaller embedding and head."""
ATOL = 1e-4
MAX_NEW = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(V4 release-format folder, fp32 folder of its dequantized weights under the HF names)."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import dequantize_release_tensors, quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8-v4")
    src = make_tiny_checkpoint("deepseek_v4", root / "src", seed=0, **DIMS)
    v4 = quantize_checkpoint(src, root / "v4", "v4", torch.bfloat16)
    dequantized = dequantize_release_tensors(load_file(v4 / "model.safetensors"))
    ref = checkpoint_folder(src, root / "dequant", dequantized, json.loads((src / "config.json").read_text()))
    return v4, ref


def test_release_format_as_written(ckpts):
    v4, _ = ckpts
    config = json.loads((v4 / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert config["expert_dtype"] == "fp4"
    t = load_file(v4 / "model.safetensors")
    attn, ffn = "layers.1.attn", "layers.2.ffn"
    assert t[f"{attn}.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t[f"{attn}.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t[f"{attn}.wq_a.scale"].shape == (2, 2)  # 160 x 192
    assert t[f"{attn}.wo_b.scale"].shape == (2, 1)  # 192 x 32
    assert t[f"{attn}.indexer.wq_b.scale"].shape == (1, 2)  # 128 x 160
    assert t[f"{ffn}.shared_experts.w2.scale"].shape == (2, 1)  # 192 x 64
    w1, s1 = t[f"{ffn}.experts.3.w1.weight"], t[f"{ffn}.experts.3.w1.scale"]
    assert (w1.dtype, tuple(w1.shape), s1.dtype, tuple(s1.shape)) == (torch.int8, (64, 96), torch.float8_e8m0fnu,
                                                                      (64, 6))
    assert w1.shape[-1] // s1.shape[-1] == 16  # the packed ratio; 32 elements per scale
    assert t[f"{ffn}.experts.3.w2.scale"].shape == (192, 2)
    for name in ("embed.weight", "head.weight", f"{ffn}.gate.weight", f"{attn}.compressor.wkv.weight",
                 f"{attn}.indexer.weights_proj.weight", f"{attn}.indexer.compressor.wgate.weight"):
        assert t[name].dtype == torch.bfloat16, name
        assert name.removesuffix(".weight") + ".scale" not in t
    assert t[f"{ffn}.gate.bias"].dtype == torch.float32
    assert "hc_head_fn" in t and "norm.weight" in t and "model.embed_tokens.weight" not in t


@pytest.fixture(scope="module")
def models(ckpts):
    from transformers import AutoModelForCausalLM

    v4, ref_path = ckpts
    config, _ = load_model_config(v4)
    assert config.quantization == QuantConfig("fp8", (128, 128), "ue8m0", "fp4")
    assert config.quantization.format == "v4"
    model = build_model(config, v4, "auto", torch.float32, CPU, seed=0)
    ref = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    return config, model, ref


def test_loads_the_dequantized_weights_exactly(ckpts, models):
    _, ref_path = ckpts
    _, model, _ = models
    config, _ = load_model_config(ref_path)
    dense = build_model(config, ref_path, "auto", torch.float32, CPU, seed=0)
    want = dict(dense.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()  # no scale left once applied
    for name, p in got.items():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name


def test_prefill_logits_match_transformers_on_dequantized_weights(models):
    config, model, ref = models
    pool = new_pool(model, config)
    prompts = [prompt(i, n) for i, n in enumerate((7, 37))]
    outs = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p)) for p in prompts])
    for p, got in zip(prompts, outs):
        err = (got - hf_logits(ref, p)).abs().max().item()
        assert err <= ATOL, f"max abs logit error {err:.2e} > {ATOL:.0e}"


def test_engine_greedy_matches_the_engine_on_dequantized_weights(ckpts):
    v4, ref_path = ckpts
    prompts = [prompt(10 + i, n) for i, n in enumerate((4, 13, 30))]
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    with Engine(str(ref_path), dtype="float32", kv_cache_tokens=512) as engine:
        want = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    with Engine(str(v4), dtype="float32", kv_cache_tokens=512) as engine:
        got = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=sp)]
    assert got == want


ALIGNED_DIMS = dict(hidden_size=256, q_lora_rank=256, moe_intermediate_size=64, vocab_size=20480)
"""Every multi-block dim a multiple of 128: transformers derives the block from the scale grid (rows // scale
rows), which misreads edge blocks that span less than a block but more than one scale row (192 = 1.5 blocks)."""


@torch.no_grad()
def test_matches_transformers_fp8_integration(tmp_path):
    """transformers loads the release folder itself (its fine-grained FP8 integration reads `.scale`, ue8m0 and
    expert_dtype fp4; without a GPU it dequantizes at load); our load of that folder gives the same logits."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import quantize_checkpoint
    from transformers import AutoModelForCausalLM

    src = make_tiny_checkpoint("deepseek_v4", tmp_path / "src", seed=2, **ALIGNED_DIMS)
    v4 = quantize_checkpoint(src, tmp_path / "v4", "v4", torch.bfloat16)
    hf = AutoModelForCausalLM.from_pretrained(v4, dtype=torch.float32).eval()
    config, _ = load_model_config(v4)
    model = build_model(config, v4, "auto", torch.float32, CPU, seed=0)
    p = prompt(3, 23)
    pool = new_pool(model, config)
    (got,) = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p))])
    err = (got - hf_logits(hf, p)).abs().max().item()
    assert err <= ATOL, err


@pytest.fixture(scope="module")
def v4_tensors(ckpts):
    return load_file(ckpts[0] / "model.safetensors")


def _load(ckpts, v4_tensors, tmp_path, **changes) -> None:
    """Load the release tensors with `changes` (name with '__' for '.') as build_model would from a folder."""
    config, _ = load_model_config(ckpts[0])
    tensors = dict(v4_tensors, **{k.replace("__", "."): v for k, v in changes.items()})
    with build_context(KernelConfig.from_env(CPU).for_checkpoint(config.quantization)):
        model = get_model_class(config.architecture)(config)
    model.load_weights(tensors.items())


def _all_experts(tensors, layer: int, proj: str, fn) -> dict[str, torch.Tensor]:
    """Every expert of one layer's `proj` changed alike (a writer's systematic mistake, not one bad tensor)."""
    prefix = f"layers.{layer}.ffn.experts"
    return {f"{prefix}.{e}.{proj}".replace(".", "__"): fn(tensors[f"{prefix}.{e}.{proj}"]) for e in range(8)}


def test_expert_dtype_detected_from_the_tensors(ckpts, tmp_path):
    """A config without expert_dtype: int8 expert weights in the safetensors headers mean MXFP4."""
    v4, _ = ckpts
    config = json.loads((v4 / "config.json").read_text())
    del config["expert_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(v4 / "model.safetensors")
    detected, _ = load_model_config(tmp_path)
    assert detected.quantization.expert_dtype == "fp4" and detected.quantization.format == "v4"


def test_wrong_dense_block_names_the_tensor(ckpts, v4_tensors, tmp_path):
    scale = v4_tensors["layers.1.attn.wq_a.scale"]  # 32 x 32 blocks (V4.1's) where the config says 128 x 128
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a.*scale shape \(5, 6\) != \(2, 2\).*derives 32x32"):
        _load(ckpts, v4_tensors, tmp_path, layers__1__attn__wq_a__scale=scale.repeat_interleave(3, 0)[:5]
              .repeat_interleave(3, 1))


@pytest.mark.parametrize("per, derived", [(16, r"1x16-element blocks \(1x8 on disk"),
                                          (64, r"1x64-element blocks \(1x32 on disk")])
def test_mxfp4_block_confusion_names_the_tensor(ckpts, v4_tensors, tmp_path, per, derived):
    """Scales per 16 elements (NVFP4's block, what the on-disk ratio 16 suggests) or per 32 packed bytes (64
    elements) are refused, not read as MXFP4."""
    groups = 192 // per
    changes = {}
    for proj in ("w1", "w3"):
        changes |= _all_experts(v4_tensors, 2, f"{proj}.scale", lambda s: s[:, :1].expand(64, groups).contiguous())
    with pytest.raises(ValueError, match=r"layers\.2\.ffn\.experts\.gate_up_proj.*" + derived):
        _load(ckpts, v4_tensors, tmp_path, **changes)


def test_bf16_where_fp8_is_due_names_the_tensor(ckpts, v4_tensors, tmp_path):
    w = v4_tensors["layers.3.ffn.shared_experts.w1.weight"].to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"shared_experts\.w1\.weight.*bfloat16 weight .*float8_e4m3fn"):
        _load(ckpts, v4_tensors, tmp_path, layers__3__ffn__shared_experts__w1__weight=w)


def test_uneven_expert_tensors_name_the_layer(ckpts, v4_tensors, tmp_path):
    changes = _all_experts(v4_tensors, 2, "w1.scale", lambda s: s[:, :3].contiguous())
    with pytest.raises(ValueError, match=r"layers\.2\.ffn\.experts: per-expert_scale_inv tensors of unequal shapes"):
        _load(ckpts, v4_tensors, tmp_path, **changes)


def test_unpacked_experts_where_mxfp4_is_due_name_the_tensor(ckpts, v4_tensors, tmp_path):
    """V3-style FP8 experts (e4m3, one byte per element) in a checkpoint whose config says expert_dtype fp4."""
    changes = _all_experts(v4_tensors, 1, "w2.weight", lambda w: torch.zeros(192, 64, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"layers\.1\.ffn\.experts\.down_proj.*float8_e4m3fn expert weight.*fp4"):
        _load(ckpts, v4_tensors, tmp_path, **changes)
