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
    from deepinfer_rt.layers import mla_prefill

    layer, pool = layer_pool
    monkeypatch.setattr(layer, "prefix_split", True)
    monkeypatch.setattr(layer, "is_padded_prefill", padded)
    monkeypatch.setattr(mla_prefill, "_v_width_refused", False)
    widths, padded_builds = [], []
    inner, inner_pad = mla_prefill.attention_with_lse, layer.padded_kv_b
    monkeypatch.setattr(mla_prefill, "attention_with_lse", lambda q, k, v, *a: widths.append(v.shape[-1]) or inner(
        q, k, v, *a))
    monkeypatch.setattr(layer, "padded_kv_b", lambda: padded_builds.append(1) or inner_pad())
    absorbed, mha = both_forms(layer, pool, TorchRefBackend(), CASES[case], 2)
    torch.testing.assert_close(mha, absorbed, rtol=1e-4, atol=1e-5)
    over_prefix = sum(1 for prefix, _ in CASES[case] if prefix)  # chunks of >= 2 new tokens over a prefix
    over_prefix -= sum(1 for prefix, new in CASES[case] if prefix and new < 2)
    assert widths == [layer.v_dim] * (2 * over_prefix)  # two cuDNN-form calls a chunk, V at its own width
    fresh = sum(1 for prefix, new in CASES[case] if not prefix and new >= 2)
    assert len(padded_builds) == (fresh if padded else 0)  # only the chunks without a prefix build padded K / V


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
    monkeypatch.setattr(mla_prefill, "_v_width_refused", False)

    def refuse(*args):
        raise RuntimeError("cuDNN Frontend error: No execution plans support the graph.")

    monkeypatch.setattr(mla_prefill, "prefix_split_attention", refuse)
    qk = layer.nope_dim + layer.rope_dim
    masked_widths, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, **kw):
        if q.shape[-1] == qk and kw.get("attn_mask") is not None:  # the standard form's masked calls only
            masked_widths.append(v.shape[-1])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(mla_prefill.F, "scaled_dot_product_attention", record)
    absorbed, mha = both_forms(layer, pool, TorchRefBackend(), CASES["mixed"], 2)
    torch.testing.assert_close(mha, absorbed, rtol=1e-4, atol=1e-5)
    assert mla_prefill._prefix_split_refused.startswith("cuDNN Frontend error")
    assert sum("prefix split failed" in r.message for r in caplog.records) == 1
    # the two refused chunks over a prefix: masked calls, V padded to q.k's width on the padded (GPU) layer
    assert masked_widths == [qk if padded else layer.v_dim] * 2


def test_narrow_v_refused_retries_padded(layer_pool, monkeypatch, caplog):
    """cuDNN refusing V narrower than q.k: the call is made again with V padded (the output unchanged), and V is
    padded for cuDNN's calls from then on; the split itself stays on."""
    from deepinfer_rt.layers import mla_prefill

    layer, pool = layer_pool
    monkeypatch.setattr(layer, "prefix_split", True)
    monkeypatch.setattr(mla_prefill, "_prefix_split_refused", None)
    monkeypatch.setattr(mla_prefill, "_v_width_refused", False)
    widths, inner = [], mla_prefill.attention_with_lse

    def narrow_refused(q, k, v, *a):
        widths.append(v.shape[-1])
        if v.shape[-1] != q.shape[-1]:
            raise RuntimeError("cuDNN Frontend error: No execution plans support the graph.")
        return inner(q, k, v, *a)

    monkeypatch.setattr(mla_prefill, "attention_with_lse", narrow_refused)
    absorbed, mha = both_forms(layer, pool, TorchRefBackend(), [(18, 12), (7, 11)], 2)
    torch.testing.assert_close(mha, absorbed, rtol=1e-4, atol=1e-5)
    qk = layer.nope_dim + layer.rope_dim
    assert widths == [layer.v_dim, qk, qk, qk, qk]  # refused once, then padded for both chunks' two calls
    assert mla_prefill._v_width_refused and mla_prefill._prefix_split_refused is None
    assert sum("V is padded" in r.message for r in caplog.records) == 1


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
