"""MLA prefill in the standard (MHA) form equals the absorbed form (CPU, fp32) on a tiny DeepSeek-V3 layer."""
from __future__ import annotations

import pytest
import torch
from mla_cases import CASES, both_forms, load_layer, make_batch

from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.attention.torch_ref import causal_mask
from deepinfer_rt.layers.mla_prefill import build_plan, is_prefix_split, min_mha_queries, prefix_split_attention


@pytest.fixture(scope="module")
def layer_pool(tiny_v3_path):
    return load_layer(tiny_v3_path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("min_queries", [2, 8])
def test_mha_form_matches_absorbed(layer_pool, case, min_queries):
    layer, pool = layer_pool
    absorbed, mha = both_forms(layer, pool, TorchRefBackend(), CASES[case], min_queries)
    assert absorbed.abs().max() > 1e-3  # a real signal, not an all-zero output
    torch.testing.assert_close(mha, absorbed, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["chunk_after_prefix", "mixed"])
@pytest.mark.parametrize("padded", [False, True])
def test_prefix_split_matches_absorbed(layer_pool, monkeypatch, case, padded):
    """Chunks over a prefix attending as prefix + own keys merged by log-sum-exp give the absorbed output. padded:
    the GPU's layer, whose other chunks expand K and V through padded_kv_b while the split's keep V's width."""
    layer, pool = layer_pool
    monkeypatch.setattr(layer, "prefix_split", True)
    monkeypatch.setattr(layer, "is_padded_prefill", padded)
    absorbed, mha = both_forms(layer, pool, TorchRefBackend(), CASES[case], 2)
    torch.testing.assert_close(mha, absorbed, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n, prefix, dv", [(1, 5, 16), (7, 1, 24), (16, 48, 16), (33, 100, 8), (4, 9, 24)])
def test_prefix_split_attention_matches_masked_sdpa(n, prefix, dv):
    g = torch.Generator().manual_seed(n * 1000 + prefix)
    heads, d = 3, 24
    q = torch.randn(1, heads, n, d, generator=g)
    k = torch.randn(1, heads, prefix + n, d, generator=g) * 2
    v = torch.randn(1, heads, prefix + n, dv, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(n, prefix + n, q.device),
                                                            scale=0.3)
    got = prefix_split_attention(q, k, v, 0.3)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_prefix_split_policy():
    cpu32, cpu16 = torch.zeros(2048, 1), torch.zeros(2048, 1, dtype=torch.bfloat16)
    assert not is_prefix_split(None, cpu32, 1024) and not is_prefix_split(None, cpu16, 1024)  # CUDA only
    assert is_prefix_split(True, cpu32, 5) and not is_prefix_split(False, cpu16, 1024)
    assert not is_prefix_split(True, cpu32, 0)  # no prefix: the plain causal call


def test_prefix_split_without_prefix_is_causal_attention():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(prefix_split_attention(q, k, v, 0.25), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("padded", [False, True])
def test_refused_split_falls_back_to_the_masked_call(layer_pool, monkeypatch, caplog, padded):
    """A split call that raises (a cuDNN that refuses the shapes) leaves the masked call to every later chunk,
    with one warning; the output is unchanged. padded: V, built at its own width for the split, is padded for the
    masked call (flash's one head width on the GPU)."""
    from deepinfer_rt.layers import mla_prefill

    layer, pool = layer_pool
    monkeypatch.setattr(layer, "prefix_split", True)
    monkeypatch.setattr(layer, "is_padded_prefill", padded)
    monkeypatch.setattr(mla_prefill, "_prefix_split_refused", None)

    def refuse(*args):
        raise RuntimeError("cuDNN Frontend error: No execution plans support the graph.")

    monkeypatch.setattr(mla_prefill, "prefix_split_attention", refuse)
    absorbed, mha = both_forms(layer, pool, TorchRefBackend(), CASES["mixed"], 2)
    torch.testing.assert_close(mha, absorbed, rtol=1e-4, atol=1e-5)
    assert mla_prefill._prefix_split_refused.startswith("cuDNN Frontend error")
    assert sum("prefix split failed" in r.message for r in caplog.records) == 1


def test_plan_splits_rows(layer_pool):
    """Decode rows and short extends stay absorbed, as a prepared batch of their own; long chunks go MHA."""
    layer, pool = layer_pool
    batch, _ = make_batch(layer, pool, TorchRefBackend(), CASES["mixed"], seed=1)
    plan = build_plan(batch, 8)
    assert [(s.q_start, s.q_len) for s in plan.segments] == [(1, 16), (21, 11)]
    assert plan.segments[0].mask is None and plan.segments[1].mask.shape == (11, 18)
    assert plan.absorbed_rows.tolist() == [0, 17, 18, 19, 20]
    assert plan.absorbed.q_lens == [1, 1, 3] and plan.absorbed.kv_lens == [10, 26, 13]
    assert plan.absorbed.attn_meta is not None
    assert not build_plan(batch, None).segments and not build_plan(batch, 17).segments


def test_policy(monkeypatch):
    from deepinfer_rt.layers.attention.triton import TritonBackend

    torch_ref, triton = TorchRefBackend(), TritonBackend  # the flag is a class attribute (no device needed)
    monkeypatch.delenv("DEEPINFER_MLA_MHA_PREFILL", raising=False)
    assert min_mha_queries(KernelConfig.from_env(), torch_ref) is None
    assert min_mha_queries(KernelConfig.from_env(), triton) == 64
    monkeypatch.setenv("DEEPINFER_MLA_MHA_PREFILL", "1")
    assert min_mha_queries(KernelConfig.from_env(), torch_ref) == 2
    assert min_mha_queries(KernelConfig.from_env(batch_invariant=True), torch_ref) is None
    monkeypatch.setenv("DEEPINFER_MLA_MHA_PREFILL", "0")
    assert min_mha_queries(KernelConfig.from_env(), triton) is None
