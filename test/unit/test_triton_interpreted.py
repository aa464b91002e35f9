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


def _interpret(code: str) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_moe_router_kernel_equals_torch_form():
    assert _interpret(_ROUTER).strip().endswith("ok")
