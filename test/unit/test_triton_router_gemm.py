"""The router GEMM kernel (MoE router logits, fp32, one launch): through Triton's interpreter on CPU, close to a
float64 reference for ragged T, E and H, rows bitwise the same alone and inside larger batches, and T = 0. The
split of the weight into bf16 pieces for the tensor-core form is exact. The compiled kernels on a GPU:
test/gpu/test_gpu_kernels.py (the interpreter's bf16 tl.dot is not IEEE)."""
from __future__ import annotations

import textwrap

import pytest
import torch

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


def test_split_weight_pieces_sum_to_the_weight():
    from deepinfer_kernels.router_gemm import split_weight

    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 200, generator=g) * torch.logspace(-3, 1, 200)  # entries over four decades
    pieces = split_weight(w)
    assert pieces.shape == (3, 70, 200) and pieces.dtype == torch.bfloat16
    assert torch.equal(pieces.double().sum(0), w.double())  # 3 x 8 significant bits hold fp32's 24
    for bigger, smaller in ((0, 1), (1, 2)):  # each piece holds the bits below the one before: hi, mid, lo
        assert (pieces[smaller].float().abs() <= pieces[bigger].float().abs() * 2**-8).all()
    assert pieces[2].abs().max() > 0  # the lo piece is used
