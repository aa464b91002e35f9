"""The skinny GEMM kernel (dense projections at decode batch <= 16 on CUDA) through Triton's interpreter on
CPU: close to F.linear for 1..16 rows, ragged N and K, strided rows and a bias. The GPU suite runs it compiled
and autotuned."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_SKINNY = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from deepinfer_kernels.skinny_gemm import skinny_gemm
    g = torch.Generator().manual_seed(0)
    config = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
    for m, n, k in ((1, 40, 96), (5, 33, 80), (16, 64, 48)):
        w = (torch.randn(n, k, generator=g) / k**0.5).half()
        bias = torch.randn(n, generator=g).half()
        x = torch.randn(m, k + 16, generator=g).half()[:, 16:]  # strided rows
        y = skinny_gemm(x, w, bias, config=config)
        ref = F.linear(x.float(), w.float(), bias.float())
        torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3)
        y3 = skinny_gemm(x.contiguous().view(1, m, k), w, config=config)
        assert y3.shape == (1, m, n)
        torch.testing.assert_close(y3[0].float(), F.linear(x.float(), w.float()), rtol=2e-3, atol=2e-3)
    print("ok")
""")


def test_skinny_gemm_close_to_linear():
    assert _interpret(_SKINNY).strip().endswith("ok")
