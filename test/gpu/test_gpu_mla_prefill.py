"""MLA prefill in the standard (MHA) form on CUDA (skipped without a GPU): one layer against the absorbed form
(fp32 and bf16, through the Triton backend), the flash kernel taking it, and whole engines (auto and forced
MHA form) against the CPU reference engine (absorbed)."""
from __future__ import annotations

import random

import pytest
import torch
from mla_cases import CASES, both_forms, load_layer, make_batch
from torch.nn.attention import SDPBackend, sdpa_kernel

from deepinfer_rt import Engine, SamplingParams
from deepinfer_rt.layers import mla_prefill
from deepinfer_rt.layers.attention.triton import TritonBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda")
TOLERANCE = {torch.float32: {"rtol": 1e-3, "atol": 2e-4}, torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


def _tiny(kind: str, tmp_path_factory):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    return make_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    return _tiny("deepseek_v3", tmp_path_factory)


@pytest.mark.parametrize("dtype, split", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, True)])
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_mha_form_matches_absorbed(v3_path, dtype, split, case):
    """split True: chunks over a prefix take the two cuDNN calls whatever their alignment."""
    layer, pool = load_layer(v3_path, dtype, CUDA)
    layer.prefix_split = split
    absorbed, mha = both_forms(layer, pool, TritonBackend(CUDA), CASES[case], 2)
    assert absorbed.abs().max() > 1e-2
    torch.testing.assert_close(mha.float(), absorbed.float(), **TOLERANCE[dtype])


def test_gpu_aligned_chunks_take_cudnn_at_v_width(v3_path, monkeypatch):
    """The default policy on chunks aligned to PREFIX_SPLIT_ALIGN (a first chunk, and one over a cached prefix):
    cuDNN's calls with V at its own width, no padded GEMM, against the absorbed form."""
    if not mla_prefill._is_cudnn_split_device(CUDA.index):
        pytest.skip("the split is off on this device / cuDNN by default")
    monkeypatch.setattr(mla_prefill, "_prefix_split_refused", None)  # an earlier test's refusal does not carry over
    monkeypatch.setattr(mla_prefill, "_v_width_refused", False)
    layer, pool = load_layer(v3_path, torch.bfloat16, CUDA, num_slots=4096)
    calls = []
    inner = mla_prefill.attention_with_lse
    monkeypatch.setattr(mla_prefill, "attention_with_lse", lambda q, k, v, *a: calls.append(v.shape[-1]) or inner(
        q, k, v, *a))
    monkeypatch.setattr(layer, "padded_kv_b", lambda: pytest.fail("an aligned chunk built the padded K / V"))
    seqs = [(1024, 1024), (0, 1024)]
    absorbed, mha = both_forms(layer, pool, TritonBackend(CUDA), seqs, 2)
    assert calls == [layer.v_dim] * 3  # prefix and own keys of the first sequence, one causal call for the second
    torch.testing.assert_close(mha.float(), absorbed.float(), **TOLERANCE[torch.bfloat16])


def test_gpu_mha_form_takes_flash(v3_path):
    """With only the flash kernel allowed, fresh prompts and chunks over a prefix both still run."""
    layer, pool = load_layer(v3_path, torch.bfloat16, CUDA)
    layer.prefix_split = False  # the split's cuDNN calls bypass sdpa_kernel's choice
    batch, hidden = make_batch(layer, pool, TritonBackend(CUDA), CASES["mixed"], seed=1)
    batch.mla_plan = mla_prefill.build_plan(batch, 2)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.no_grad():
        out = layer(hidden, batch)
    assert torch.isfinite(out).all()


def _engine(path, device: str) -> Engine:
    return Engine(str(path), dtype="float32", device=device, kv_cache_tokens=4096, max_num_seqs=8,
                  chunked_prefill_tokens=96)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("forced", [False, True])
def test_gpu_engine_mha_prefill_matches_cpu_reference(tmp_path_factory, monkeypatch, kind, forced):
    path = _tiny(kind, tmp_path_factory)
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
    with _engine(path, "cpu") as cpu:
        rng = random.Random(0)
        prompts = [[rng.randrange(cpu.model_config.vocab_size) for _ in range(n)] for n in (70, 150, 9, 200)]
        ref = cpu.generate(input_ids=prompts, sampling_params=sp)
    if forced:
        monkeypatch.setenv("DEEPINFER_MLA_MHA_PREFILL", "1")
    plans, inner = [], mla_prefill.build_plan
    monkeypatch.setattr(mla_prefill, "build_plan", lambda b, m: plans.append(inner(b, m)) or plans[-1])
    with _engine(path, "cuda") as gpu:
        out = gpu.generate(input_ids=prompts, sampling_params=sp)
    assert any(s.mask is not None for p in plans for s in p.segments)  # a chunk over a prefix ran MHA
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 2e-2


@pytest.mark.parametrize("n, prefix", [(64, 1), (512, 1536), (1000, 3000), (1024, 0)])
@pytest.mark.parametrize("dv", [192, 128])
def test_gpu_prefix_split_attention_matches_masked_sdpa(n, prefix, dv):
    """cuDNN's two calls merged by log-sum-exp (one causal call without a prefix) against one masked SDPA in fp32,
    V2-Lite head dims: V padded to q.k's 192 (zero columns), or at its own 128 as aligned chunks feed it."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator(device=CUDA).manual_seed(n)
    q, k, v = (torch.randn(1, 16, length, 192, device=CUDA, generator=g, dtype=torch.bfloat16)
               for length in (n, prefix + n, prefix + n))
    v[..., 128:] = 0
    v = v[..., :dv]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=causal_lower_right(n, prefix + n), scale=0.07)
    got = mla_prefill.prefix_split_attention(q, k, v, 0.07)
    assert got.dtype == torch.bfloat16 and got.shape[-1] == dv
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    if dv > 128:
        assert got[..., 128:].abs().max() == 0
