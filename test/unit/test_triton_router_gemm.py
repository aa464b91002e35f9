"""The router GEMM kernel (MoE router logits, fp32, one launch): through Triton's interpreter on CPU, close to a
float64 reference for ragged T, E and H, rows bitwise the same alone and inside larger batches, and T = 0; on a
GPU, compiled, against F.linear(x.float(), w) at DeepSeek-V2-Lite's router shape."""
from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from test_triton_interpreted import _interpret

_ROUTER_GEMM = textwrap.dedent("""
    import torch
    from deepinfer_kernels.router_gemm import router_logits
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for e, h in ((64, 256), (70, 200)):  # 70: an expert tail; 200: a K tail
            w = torch.randn(e, h, generator=g) / h**0.5
            for t in (1, 5, 37):
                x = torch.randn(t, h + 8, generator=g).to(dtype)[:, 8:]  # strided rows
                y = router_logits(x, w)
                assert y.dtype == torch.float32 and y.shape == (t, e)
                torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
        rows = x[[0, 17, 36]]  # of the last (ragged) shape: alone, then among random rows in other batch sizes
        alone = torch.cat([router_logits(rows[i : i + 1], w) for i in range(3)])
        for t, at in ((8, 5), (40, 21)):
            batch = torch.randn(t, h, generator=g).to(dtype)
            batch[at : at + 3] = rows
            assert torch.equal(router_logits(batch, w)[at : at + 3], alone), (dtype, t)
    assert router_logits(torch.empty(0, 200, dtype=torch.bfloat16), w).shape == (0, 70)
    print("ok")
""")


def test_router_gemm_close_and_batch_invariant():
    assert _interpret(_ROUTER_GEMM).strip().endswith("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_gemm_matches_linear_on_gpu():
    from deepinfer_kernels.router_gemm import router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64, 2048, generator=g, device="cuda") / 2048**0.5
    x = torch.randn(8192, 2048, generator=g, device="cuda").bfloat16()
    alone = router_logits(x[:3], w)
    for t in (1, 64, 256, 8192):
        y = router_logits(x[:t], w)
        torch.testing.assert_close(y, F.linear(x[:t].float(), w), rtol=1e-4, atol=1e-4)
        assert torch.equal(y[:3], alone[:t])
    assert torch.equal(router_logits(x[-1:], w), y[-1:])
