"""DeepSeek-V4.1's DSpark drafter from a release-format checkpoint (CPU, fp32).

A tiny V4.1 (config 'a') with DSpark stages, widened so that every quantized dim spans several blocks (hidden 96,
expert width 64), is written in the V4.1 release format by scripts/quantize_checkpoint.py --format v41: the stages'
attention and shared experts FP8 with e8m0 32 x 32 scales, their routed experts MXFP4 and main_proj FP8, as the
target's layers (V4's release ships its MTP layer quantized the same way); the Markov and confidence heads 16-bit.
Speculative decoding keeps the target's greedy tokens, and the drafter's proposals equal those of the same checkpoint
dequantized to fp32. A copy with main_proj 16-bit loads too.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer_rt import Engine, SamplingParams
from helpers import checkpoint_folder

pytestmark = pytest.mark.usefixtures("single_thread")

DIMS = dict(hidden_size=96, moe_intermediate_size=64, q_lora_rank=48, engram_head_dim=32)
PROMPTS = [[3, 17, 5, 40, 2, 9], list(range(4, 30))]
GREEDY = SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{form: (release-format folder, fp32 folder of its dequantized weights)}, main_proj FP8 or 16-bit."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import V41_BLOCK, dequantize_release_tensors, quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8-v41-dspark")
    src = make_tiny_checkpoint("deepseek_v41", root / "src", seed=2, variant="a", dspark=True, **DIMS)
    v41 = quantize_checkpoint(src, root / "v41", "v41", torch.bfloat16)
    tensors = load_file(v41 / "model.safetensors")
    plain_proj = {k: v for k, v in tensors.items() if k != "mtp.0.main_proj.scale"}
    plain_proj["mtp.0.main_proj.weight"] = dequantize_release_tensors(
        {k: tensors[k] for k in ("mtp.0.main_proj.weight", "mtp.0.main_proj.scale")},
        V41_BLOCK)["mtp.0.main_proj.weight"].to(torch.bfloat16)
    v41_plain = checkpoint_folder(v41, root / "v41_plain", plain_proj, copy_folders=True)
    out = {}
    for form, folder in (("main_proj_fp8", v41), ("main_proj_16bit", v41_plain)):
        ref = dequantize_release_tensors(load_file(folder / "model.safetensors"), V41_BLOCK)
        out[form] = folder, checkpoint_folder(src, root / f"{form}_dequant", ref, copy_folders=True)
    return out


def test_release_layout_of_the_stages(ckpts):
    v41, _ = ckpts["main_proj_fp8"]
    t = load_file(v41 / "model.safetensors")
    for name in ("mtp.0.attn.wq_a", "mtp.1.attn.wo_b", "mtp.0.ffn.shared_experts.w2", "mtp.0.main_proj"):
        assert t[f"{name}.weight"].dtype == torch.float8_e4m3fn, name
        assert t[f"{name}.scale"].dtype == torch.float8_e8m0fnu, name
    w1, s1 = t["mtp.1.ffn.experts.1.w1.weight"], t["mtp.1.ffn.experts.1.w1.scale"]
    assert (w1.dtype, w1.shape[-1] // s1.shape[-1]) == (torch.int8, 16)  # MXFP4: 32 elements a scale, packed
    for name in ("mtp.1.markov_head.head", "mtp.1.confidence_head.proj", "mtp.0.ffn.gate"):
        assert t[f"{name}.weight"].dtype == torch.bfloat16 and f"{name}.scale" not in t, name
    assert json.loads((v41 / "config.json").read_text())["quantization_config"]["weight_block_size"] == [32, 32]


def _run(path: Path, speculative):
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, speculative=speculative) as e:
        tokens = [o.token_ids for o in e.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        if speculative is None:
            return tokens, None, None
        proposals = {rid: (p.tokens, p.confidences) for rid, p in e.spec.drafter._proposals.items()}
        return tokens, sorted(proposals.values()), e.stats["spec"]


@pytest.mark.parametrize("form", ["main_proj_fp8", "main_proj_16bit"])
def test_release_dspark_drafts_equal_the_dequantized_checkpoints(ckpts, form):
    v41, ref = ckpts[form]
    plain, _, _ = _run(v41, None)
    tokens, proposals, stats = _run(v41, "dspark")
    ref_tokens, ref_proposals, ref_stats = _run(ref, "dspark")
    assert tokens == plain == ref_tokens
    assert stats["drafted"] > 0 and stats == ref_stats
    assert [p[0] for p in proposals] == [p[0] for p in ref_proposals]
    for (_, conf), (_, ref_conf) in zip(proposals, ref_proposals):
        assert conf == pytest.approx(ref_conf, abs=1e-5)
