"""MTP drafting from a DeepSeek-V3 release-format FP8 checkpoint (CPU, fp32).

A tiny V3 with an MTP layer (model.layers.{N}.*) is written in the release format by scripts/quantize_checkpoint.py:
the MTP decoder layer's linears FP8 with 128 x 128 scales like the target's, eh_proj 16-bit as in the V3 / R1
releases. A second copy ships eh_proj in FP8 with its scale (the form some quantizers write). On each, speculative
decoding keeps the target's greedy tokens, and the drafter's proposals and confidences equal those of the same
checkpoint dequantized to fp32 (the drafter read its FP8 weights as the dequantized ones).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_speculative import PROMPTS, add_mtp_layer

from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks
from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.speculative.config import SpeculativeConfig

MTP = SpeculativeConfig("mtp", fixed_length=True, max_draft=3)
PARAMS = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)


def _rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.fixture(scope="module")
def ckpts(tiny_v3_path, tmp_path_factory):
    """{name: (FP8 folder, fp32 folder of its dequantized weights)} for eh_proj 16-bit and FP8."""
    from quantize_checkpoint import quantize_checkpoint

    root = tmp_path_factory.mktemp("fp8-mtp")
    mtp = add_mtp_layer(tiny_v3_path, root / "mtp")
    fp8 = quantize_checkpoint(mtp, root / "fp8", "v3-fp8")
    tensors = load_file(fp8 / "model.safetensors")
    n = json.loads((fp8 / "config.json").read_text())["num_hidden_layers"]
    eh = f"model.layers.{n}.eh_proj.weight"
    q, s = quantize_fp8_blocks(tensors[eh].float())
    fp8_eh = _rewrite(fp8, root / "fp8_eh", dict(tensors, **{eh: q, eh + "_scale_inv": s}),
                      json.loads((fp8 / "config.json").read_text()))
    out = {}
    for name, folder in (("eh_16bit", fp8), ("eh_fp8", fp8_eh)):
        t = load_file(folder / "model.safetensors")
        dequant = {k: dequantize_fp8_blocks(v, t[k + "_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v.float()
                   for k, v in t.items() if not k.endswith("_scale_inv")}
        config = json.loads((folder / "config.json").read_text())
        config.pop("quantization_config")
        out[name] = folder, _rewrite(folder, root / f"{name}_dequant", dequant, dict(config, dtype="float32"))
    return out


def test_release_layout_of_the_mtp_layer(ckpts):
    fp8, _ = ckpts["eh_16bit"]
    t = load_file(fp8 / "model.safetensors")
    n = json.loads((fp8 / "config.json").read_text())["num_hidden_layers"]
    layer = f"model.layers.{n}"
    assert t[f"{layer}.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert t[f"{layer}.mlp.experts.0.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert t[f"{layer}.eh_proj.weight"].dtype == torch.float32  # kept as the source holds it (fp32 here)
    assert f"{layer}.eh_proj.weight_scale_inv" not in t


def _run(path: Path, speculative):
    with Engine(str(path), dtype="float32", kv_cache_tokens=2048, speculative=speculative) as e:
        outs = e.generate(input_ids=PROMPTS[:1], sampling_params=PARAMS)
        proposal = next(iter(e.spec.drafter._proposals.values())) if speculative else None
        eh = e.spec.drafter.mtp.layer.eh_proj if speculative else None
        return [o.token_ids for o in outs], proposal, e.stats.get("spec"), eh


@pytest.mark.parametrize("form", ["eh_16bit", "eh_fp8"])
def test_fp8_mtp_drafts_equal_the_dequantized_checkpoints(ckpts, form):
    fp8, dequant = ckpts[form]
    plain, _, _, _ = _run(fp8, None)
    tokens, proposal, stats, eh = _run(fp8, MTP)
    ref_tokens, ref_proposal, ref_stats, ref_eh = _run(dequant, MTP)
    assert tokens == plain == ref_tokens
    assert stats["drafted"] > 0 and stats == ref_stats
    assert proposal.tokens == ref_proposal.tokens
    assert proposal.confidences == pytest.approx(ref_proposal.confidences, abs=1e-6)
    assert torch.equal(eh.weight, ref_eh.weight)  # read as its dequantized value, 16-bit or FP8 on disk
