"""MLA prefill in the standard (MHA) form equals the absorbed form (CPU, fp32) on a tiny DeepSeek-V3 layer."""
from __future__ import annotations

import pytest
import torch
from mla_cases import CASES, both_forms, load_layer, make_batch

from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.mla_prefill import build_plan, min_mha_queries


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
