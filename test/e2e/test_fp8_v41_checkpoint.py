"""DeepSeek-V4.1 release checkpoints (FP8 e4m3 with e8m0 32 x 32 dense blocks, MXFP4 routed experts, FP8 Engram
tables with an e8m0 scale per 32 columns) on CPU, fp32.

Both tiny configs of scripts/tiny_deepseek_v41.py ('a' with HF names, 'b' with the release's names and
inference/config.json), widened so that every quantized dim spans several blocks and some end inside one (hidden
96 = 3 dense blocks and 3 MXFP4 groups, q_lora 48 = 1.5 blocks, expert width 64 = 2 groups, Engram rows of 32
columns), are saved in fp32, written in the V4.1 release format by scripts/quantize_checkpoint.py --format v41 and
loaded by the engine: dense weights and experts dequantize at load, the Engram tables stay FP8 and decode per
fetched row. The references run on the same weights dequantized (value x 2^e in fp32, a plain fp32 checkpoint under
the HF names): the engine token for token, and the plain oracle (test/reference/deepseek_v41_ref.py) by logits.
Format mismatches are refused naming the tensor.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_deepseek_v41 import new_pool, prompt, step

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.config import QuantConfig
from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
from deepinfer_rt.models.deepseek_v41.engram import Fp8EngramTable
from deepinfer_rt.models.loader import build_model, load_model_config
from deepinfer_rt.models.registry import get_model_class
from helpers import checkpoint_folder

pytestmark = pytest.mark.usefixtures("single_thread")

CPU = torch.device("cpu")
DIMS = dict(hidden_size=96, moe_intermediate_size=64, q_lora_rank=48, engram_head_dim=32)
ATOL = 1e-4
MAX_NEW = 6
SEEDS = {"a": 0, "b": 1}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """variant -> (V4.1 release-format folder, fp32 folder of its dequantized weights under the HF names)."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import V41_BLOCK, dequantize_release_tensors, quantize_checkpoint

    out = {}
    for variant, seed in SEEDS.items():
        root = tmp_path_factory.mktemp(f"fp8-v41{variant}")
        src = make_tiny_checkpoint("deepseek_v41", root / "src", seed=seed, variant=variant,
                                   names="hf" if variant == "a" else "release", **DIMS)
        v41 = quantize_checkpoint(src, root / "v41", "v41", torch.bfloat16)
        dequantized = dequantize_release_tensors(load_file(v41 / "model.safetensors"), V41_BLOCK)
        ref = checkpoint_folder(src, root / "dequant", dequantized)
        out[variant] = v41, ref
    return out


def test_release_format_as_written(ckpts):
    v41, _ = ckpts["a"]
    config = json.loads((v41 / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                                             "expert_dtype": "fp4"}
    t = load_file(v41 / "model.safetensors")
    attn, ffn, engram = "layers.2.attn", "layers.2.ffn", "layers.1.engram"
    for name, scale in ((f"{attn}.wq_a", (2, 3)), (f"{attn}.wq_b", (3, 2)), (f"{attn}.wkv", (1, 3)),
                        (f"{attn}.wo_a", (1, 1)), (f"{attn}.wo_b", (3, 1)), (f"{ffn}.shared_experts.w2", (3, 2)),
                        (f"{engram}.wkv", (9, 4))):
        assert t[f"{name}.weight"].dtype == torch.float8_e4m3fn, name
        assert (t[f"{name}.scale"].dtype, tuple(t[f"{name}.scale"].shape)) == (torch.float8_e8m0fnu, scale), name
    w1, s1 = t[f"{ffn}.experts.3.w1.weight"], t[f"{ffn}.experts.3.w1.scale"]
    assert (w1.dtype, tuple(w1.shape), tuple(s1.shape)) == (torch.int8, (64, 48), (64, 3))
    assert w1.shape[-1] // s1.shape[-1] == 16  # the packed ratio; 32 elements per scale
    table, table_scale = t[f"{engram}.embed.weight"], t[f"{engram}.embed.scale"]
    assert (table.dtype, table_scale.dtype) == (torch.float8_e4m3fn, torch.float8_e8m0fnu)
    assert table_scale.shape == (table.shape[0], 1)
    for name in ("embed.weight", "head.weight", f"{ffn}.gate.weight", f"{attn}.compressor.wkv.weight",
                 f"{attn}.indexer.wk.weight", f"{attn}.indexer.weights_proj.weight", "layers.5.attn.compressor.wgate.weight"):
        assert t[name].dtype == torch.bfloat16, name
        assert name.removesuffix(".weight") + ".scale" not in t
    assert t[f"{ffn}.gate.bias"].dtype == torch.float32 and "model.embed_tokens.weight" not in t
    release = json.loads((ckpts["b"][0] / "inference" / "config.json").read_text())
    assert (release["dtype"], release["scale_fmt"], release["expert_dtype"]) == ("fp8", "ue8m0", "fp4")


def test_release_inference_config_reads_the_same_quantization(ckpts):
    from deepinfer_rt.models.deepseek_v41.config import v41_model_config

    v41, _ = ckpts["b"]
    composite, _ = load_model_config(v41)
    release = v41_model_config(json.loads((v41 / "inference" / "config.json").read_text()), v41)
    assert composite.quantization == release.quantization == QuantConfig("fp8", (32, 32), "ue8m0", "fp4")
    assert composite.quantization.format == "v41"


@pytest.fixture(scope="module", params=["a", "b"])
def models(request, ckpts):
    v41, ref_path = ckpts[request.param]
    config, _ = load_model_config(v41)
    ref_config, _ = load_model_config(ref_path)
    return (config, build_model(config, v41, "auto", torch.float32, CPU, seed=0),
            build_model(ref_config, ref_path, "auto", torch.float32, CPU, seed=0), ref_path)


def test_loads_the_dequantized_weights_exactly(models):
    """Every parameter equals the dequantized checkpoint's; the Engram tables stay FP8 and decode to its rows."""
    _, model, dense, _ = models
    want, got = dict(dense.named_parameters()), dict(model.named_parameters())
    tables = [n for n, m in model.named_modules() if isinstance(m, Fp8EngramTable)]
    assert tables
    for name in tables:
        table = model.get_submodule(name)
        assert table.weight.dtype == torch.float8_e4m3fn and table.weight_scale_inv.dtype == torch.uint8
        assert torch.equal(table(torch.arange(table.num_rows)), want[name + ".weight"]), name
        del got[name + ".weight"], got[name + ".weight_scale_inv"], want[name + ".weight"]
    assert got.keys() == want.keys()  # no scale left once applied
    for name, p in got.items():
        assert p.dtype == want[name].dtype and torch.equal(p, want[name]), name


def test_prefill_logits_match_the_oracle_on_dequantized_weights(models, ckpts):
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
    from deepseek_v41_ref import V41Reference

    config, model, _, ref_path = models
    text = json.loads((ref_path / "config.json").read_text())["text_config"]
    tok = AutoTokenizer.from_pretrained(ref_path)
    ids = list(range(text["vocab_size"]))
    oracle = V41Reference(text, load_file(ref_path / "model.safetensors"), tok.batch_decode([[i] for i in ids]),
                          raw_tokens=tok.convert_ids_to_tokens(ids))
    pool = new_pool(model, config)
    prompts = [prompt(i, n) for i, n in enumerate((9, 45))]
    outs = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p)) for p in prompts])
    for p, got in zip(prompts, outs):
        err = (got - oracle.logits(p)).abs().max().item()
        assert err <= ATOL, f"max abs logit error {err:.2e} > {ATOL:.0e}"


@pytest.mark.parametrize("variant", ["a", "b"])
def test_engine_greedy_matches_the_engine_on_dequantized_weights(ckpts, variant):
    v41, ref_path = ckpts[variant]
    prompts = [prompt(10 + i, n) for i, n in enumerate((4, 13, 30))]
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    outs = []
    for path in (ref_path, v41):
        with Engine(str(path), dtype="float32", kv_cache_tokens=512) as engine:
            outs.append([o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=sp)])
    assert outs[1] == outs[0] and all(len(t) == MAX_NEW for t in outs[0])


# ---- refusals ----

@pytest.fixture(scope="module")
def v41_tensors(ckpts):
    return load_file(ckpts["a"][0] / "model.safetensors")


def _load(ckpts, tensors, **changes) -> None:
    """Load the release tensors with `changes` (name with '__' for '.') as build_model would from a folder."""
    config, _ = load_model_config(ckpts["a"][0])
    tensors = dict(tensors, **{k.replace("__", "."): v for k, v in changes.items()})
    with build_context(KernelConfig.from_env(CPU).for_checkpoint(config.quantization)):
        model = get_model_class(config.architecture)(config)
    model.load_weights(tensors.items())


def test_v4_dense_block_names_the_tensor(ckpts, v41_tensors):
    """128 x 128 scales (V4's grid) where V4.1's 32 x 32 are due."""
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.wq_a.*scale shape \(1, 1\) != \(2, 3\)"):
        _load(ckpts, v41_tensors, layers__2__attn__wq_a__scale=v41_tensors["layers.2.attn.wq_a.scale"][:1, :1])


@pytest.mark.parametrize("per, derived", [(16, r"1x16-element blocks \(1x8 on disk"),
                                          (48, r"1x48-element blocks \(1x24 on disk")])
def test_mxfp4_block_confusion_names_the_tensor(ckpts, v41_tensors, per, derived):
    """Expert scales per 16 elements (NVFP4's block: what the on-disk ratio 16 suggests) or per 48."""
    changes = {}
    for e in range(4):
        for proj in ("w1", "w3"):
            name = f"layers__3__ffn__experts__{e}__{proj}__scale"
            changes[name] = v41_tensors[name.replace("__", ".")][:, :1].expand(64, 96 // per).contiguous()
    with pytest.raises(ValueError, match=r"layers\.3\.ffn\.experts\.gate_up_proj.*" + derived):
        _load(ckpts, v41_tensors, **changes)


def test_engram_scale_grid_names_the_tensor(ckpts, v41_tensors):
    """One scale per 16 columns of the table where one per 32 is due."""
    scale = v41_tensors["layers.1.engram.embed.scale"]
    with pytest.raises(ValueError, match=r"layers\.1\.engram\.embed\.weight_scale_inv.*1x16-element blocks"):
        _load(ckpts, v41_tensors, layers__1__engram__embed__scale=scale.expand(-1, 2).contiguous())


@pytest.mark.parametrize("name, dtype, message", [
    ("layers.1.engram.embed.weight", torch.bfloat16, r"engram\.embed\.weight.*bfloat16.*float8_e4m3fn"),
    ("layers.1.engram.wkv.weight", torch.bfloat16, r"engram\.wkv\.weight.*bfloat16 weight .*float8_e4m3fn"),
    ("layers.2.attn.wo_b.scale", torch.int32, r"wo_b\.weight_scale_inv.*int32 is not an e8m0 scale"),
])
def test_wrong_dtype_names_the_tensor(ckpts, v41_tensors, name, dtype, message):
    with pytest.raises(ValueError, match=message):
        _load(ckpts, v41_tensors, **{name.replace(".", "__"): v41_tensors[name].view(torch.uint8).to(dtype)})


def test_dummy_weights_of_a_release_config(ckpts):
    """load_format='dummy' from the release config alone: FP8 Engram tables get e8m0 bytes of 2^-6 (not byte 0,
    2^-127, which would zero every fetched row) and the model runs."""
    v41, _ = ckpts["a"]
    config, _ = load_model_config(v41)
    model = build_model(config, None, "dummy", torch.float32, CPU, seed=0)
    table = model.model.layers[1].engram.embed
    assert isinstance(table, Fp8EngramTable) and bool((table.weight_scale_inv == 127 - 6).all())
    rows = table(torch.arange(8))
    assert rows.abs().max() > 0.01 and torch.isfinite(rows).all()
    pool = new_pool(model, config)
    p = prompt(5, 11)
    (logits,) = step(model, pool, [(p, torch.tensor(pool.allocator.alloc(len(p))), 0, len(p))])
    assert torch.isfinite(logits).all()
