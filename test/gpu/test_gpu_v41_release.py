"""A DeepSeek-V4.1 release-format checkpoint on CUDA (skipped without a GPU): the tiny configs of
test/e2e/test_fp8_v41_checkpoint.py written by quantize_checkpoint --format v41 and built on the GPU keep their
weights quantized -- dense / attention FP8 (32 x 32 e8m0 blocks) through `auto`'s block GEMM (at these 60 rows
the W8A16 kernel, the weight tile dequantized in registers; past 256 rows the W8A8 one, activations quantized per
token and 32 channels), routed experts MXFP4 through the fused MXFP4 MoE, Engram tables FP8 -- and their prefill
logits stay near those of the same weights dequantized (an fp32 checkpoint, also on the GPU).

Tolerance: the fused MXFP4 experts are exact up to fp32 summation order (4e-7 relative on config 'a', built for
CUDA and run under TRITON_INTERPRET=1 on a CPU with the linears dequantized); the inexact step is the activations'
e4m3 rounding in every W8A8 linear, through 6-8 layers of a random model with narrow (32-channel) groups: the same
interpreted CPU run of the whole CUDA path measured 0.18 relative logit error in norm (80% argmax agreement) on
config 'a', so LOGIT_REL_ERR bounds a broken path, not FP8's quality (W8A16, which these 60 rows now take, rounds no
activation: its error here was not measured yet).

    pytest test/gpu/test_gpu_v41_release.py -s
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DIMS = dict(hidden_size=96, moe_intermediate_size=64, q_lora_rank=48, engram_head_dim=32)
LOGIT_REL_ERR = 0.3
CUDA = torch.device("cuda")


@pytest.fixture(scope="module", params=["a", "b"])
def folders(request, tmp_path_factory):
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import V41_BLOCK, dequantize_release_tensors, quantize_checkpoint

    root = tmp_path_factory.mktemp(f"gpu-v41{request.param}")
    src = make_tiny_checkpoint("deepseek_v41", root / "src", seed=0, variant=request.param, **DIMS)
    v41 = quantize_checkpoint(src, root / "v41", "v41", torch.bfloat16)
    ref = root / "dequant"
    ref.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, ref / f.name)
    save_file(dequantize_release_tensors(load_file(v41 / "model.safetensors"), V41_BLOCK),
              ref / "model.safetensors")
    return v41, ref


@torch.no_grad()
def _prefill_logits(path: Path, tokens: list[int]) -> tuple[torch.Tensor, torch.nn.Module]:
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend
    from deepinfer_rt.models.loader import build_model, load_model_config

    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, CUDA, seed=0)
    pool = KVPool(model.kv_layout(config), num_pages=256, page_size=1, dtype=torch.float32, device=CUDA)
    slots = torch.tensor(pool.allocator.alloc(len(tokens)), device=CUDA)
    backend = TorchRefBackend()
    batch = ForwardBatch(input_ids=torch.tensor(tokens, device=CUDA), positions=torch.arange(len(tokens), device=CUDA),
                         out_slots=slots, q_lens=[len(tokens)], kv_lens=[len(tokens)], kv_slots=[slots], pool=pool,
                         backend=backend)
    backend.prepare(batch)
    model.prepare_batch(batch)
    return model.compute_logits(model(batch)).float().cpu(), model


def test_release_weights_stay_quantized_and_match_dequantized(folders):
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear
    from deepinfer_rt.layers.mxfp4 import Mxfp4FusedExperts
    from deepinfer_rt.models.deepseek_v41.engram import Fp8EngramTable

    v41, ref = folders
    tokens = torch.randint(100, 20000, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    got, model = _prefill_logits(v41, tokens)
    want, _ = _prefill_logits(ref, tokens)
    layer = model.model.layers[1]
    assert isinstance(layer.ffn.experts.weights_method, Mxfp4FusedExperts)
    assert layer.ffn.experts.gate_up_proj.dtype == torch.int8
    assert isinstance(layer.attn.wq_a.method, Fp8BlockLinear) and layer.attn.wq_a.weight.dtype == torch.float8_e4m3fn
    # the grouped output projection stays dequantized at 32 x 32 blocks (Fp8BlockLinear.takes_groups)
    assert not isinstance(layer.attn.wo_a.method, Fp8BlockLinear) and layer.attn.wo_a.weight.dtype != torch.float8_e4m3fn
    assert isinstance(layer.engram.embed, Fp8EngramTable)
    err = ((got - want).norm() / want.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{v41.parent.name}: relative logit error {err:.3e}, argmax agreement {agree:.2f}")
    assert err <= LOGIT_REL_ERR


def test_release_dspark_drafter_stays_quantized(tmp_path):
    """The DSpark stages of a release checkpoint keep FP8 linears and MXFP4 experts on the GPU, as the target's
    layers do; greedy decoding with the drafter gives the tokens decoding without it gives."""
    from make_tiny_checkpoint import make_tiny_checkpoint
    from quantize_checkpoint import quantize_checkpoint

    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear
    from deepinfer_rt.layers.mxfp4 import Mxfp4FusedExperts

    src = make_tiny_checkpoint("deepseek_v41", tmp_path / "src", seed=2, variant="a", dspark=True, **DIMS)
    v41 = quantize_checkpoint(src, tmp_path / "v41", "v41", torch.bfloat16)
    prompts = [[3, 17, 5, 40, 2, 9], list(range(4, 30))]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    with Engine(str(v41), device="cuda", kv_cache_tokens=2048) as e:
        plain = [o.token_ids for o in e.generate(input_ids=prompts, sampling_params=params)]
    with Engine(str(v41), device="cuda", kv_cache_tokens=2048, speculative="dspark") as e:
        got = [o.token_ids for o in e.generate(input_ids=prompts, sampling_params=params)]
        stage = e.spec.drafter.net.stages[0]
        assert isinstance(stage.attn.wq_a.method, Fp8BlockLinear) and stage.attn.wq_a.weight.dtype == torch.float8_e4m3fn
        assert isinstance(stage.main_proj.method, Fp8BlockLinear)
        assert isinstance(stage.ffn.experts.weights_method, Mxfp4FusedExperts)
        assert stage.ffn.experts.gate_up_proj.dtype == torch.int8
        assert e.stats["spec"]["drafted"] > 0
    assert got == plain
