"""Triton kernels whose logic can run on CPU through Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported, hence a subprocess): each against its torch form, exactly. The GPU suite (test/gpu) runs
the same kernels compiled."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_ROUTER = textwrap.dedent("""
    import torch
    from deepinfer_kernels.moe_router import route
    from deepinfer_rt.layers.moe import select_experts
    for seed, (e, k, scoring, method, groups, kept, norm, scale) in enumerate([
            (64, 6, "softmax", "greedy", 1, 1, False, 1.0), (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),
            (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5), (12, 3, "softmax", "greedy", 1, 1, True, 1.0)]):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(5, e, generator=g) * 3
        bias = torch.randn(e, generator=g) * 0.1 if method == "noaux_tc" else None
        kw = dict(scoring_func=scoring, topk_method=method, n_group=groups, topk_group=kept, correction_bias=bias,
                  norm_topk_prob=norm, routed_scaling_factor=scale)
        (w, ids), (ref_w, ref_ids) = route(logits, k, **kw), select_experts(logits, k, **kw)
        assert torch.equal(ids, ref_ids), method
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    print("ok")
""")

# Batch-invariant fused MoE: three tokens alone, then inside batches of other sizes with random routing (one
# skewed so that an expert gets several row blocks), bitwise; and close to RoutedExperts' torch path. The
# interpreter multiplies bf16 tiles as their raw 16-bit integers, so 16-bit is checked in fp16 here.
_FUSED_MOE_INVARIANT = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_rt.layers.moe import RoutedExperts
    e, hidden, inter, k = 8, 64, 48, 3
    g = torch.Generator().manual_seed(0)
    experts = RoutedExperts(e, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(e, 2 * inter, hidden, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(e, hidden, inter, generator=g) * 0.1)

    def route(t, skew):
        scores = torch.rand(t, e, generator=g)
        scores[:, 0] += skew  # skew > 1: every token takes expert 0
        return torch.rand(t, k, generator=g) + 0.1, scores.topk(k, dim=-1).indices.sort(dim=-1).values

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        gate_up, down = experts.gate_up_proj.detach().to(dtype), experts.down_proj.detach().to(dtype)
        moe = lambda x, w, ids: fused_moe(x, gate_up, down, w, ids, batch_invariant=True)
        x = torch.randn(3, hidden, generator=g).to(dtype)
        w, ids = route(3, 0.0)
        alone = torch.cat([moe(x[i : i + 1], w[i : i + 1], ids[i : i + 1]) for i in range(3)])
        for t, skew in ((4, 0.0), (9, 0.0), (45, 2.0)):
            bx, (bw, bids), at = torch.randn(t, hidden, generator=g).to(dtype), route(t, skew), t // 3
            bx[at : at + 3], bw[at : at + 3], bids[at : at + 3] = x, w, ids
            assert torch.equal(moe(bx, bw, bids)[at : at + 3], alone), (dtype, t)
        ref = experts(x.float(), w, ids)
        torch.testing.assert_close(alone.float(), ref, rtol=tol, atol=tol)
    print("ok")
""")


def _interpret(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_moe_router_kernel_equals_torch_form():
    assert _interpret(_ROUTER).strip().endswith("ok")


def test_fused_moe_batch_invariant_kernels():
    assert _interpret(_FUSED_MOE_INVARIANT).strip().endswith("ok")
