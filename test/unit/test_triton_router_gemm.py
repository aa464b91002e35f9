"""The router GEMM kernel (MoE router logits, fp32, one launch): through Triton's interpreter on CPU, close to a
float64 reference for ragged T, E and H, rows bitwise the same alone and inside larger batches, and T = 0; on a
GPU, compiled, against F.linear(x.float(), w) at DeepSeek-V2-Lite's router shape. The tensor-core form over the
weight's bf16 pieces: the split is exact (CPU), the logits as close as an sgemm (GPU: the interpreter's bf16
tl.dot is not IEEE)."""
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


def test_split_weight_pieces_sum_to_the_weight():
    from deepinfer_kernels.router_gemm import split_weight

    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 200, generator=g) * torch.logspace(-3, 1, 200)  # entries over four decades
    pieces = split_weight(w)
    assert pieces.shape == (3, 70, 200) and pieces.dtype == torch.bfloat16
    assert torch.equal(pieces.double().sum(0), w.double())  # 3 x 8 significant bits hold fp32's 24
    assert (pieces[1].float().abs() <= pieces[0].float().abs() * 2**-8).all()  # each piece is the next bits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("e, h", [(64, 2048), (70, 200), (256, 7168)])
def test_router_logits_bf16_as_close_as_sgemm(e, h):
    """Tensor-core logits over the weight's bf16 pieces: as close to float64 as an fp32 sgemm of bf16 x."""
    from deepinfer_kernels.router_gemm import router_logits_bf16, split_weight

    g = torch.Generator(device="cuda").manual_seed(e)
    w = torch.randn(e, h, generator=g, device="cuda") / h**0.5
    pieces = split_weight(w)
    for t in (1, 257, 1000, 4096):
        x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
        ref = x.double() @ w.double().T
        got = router_logits_bf16(x, pieces)
        sgemm = (x.float().cpu() @ w.cpu().T).double()
        assert got.dtype == torch.float32 and got.shape == (t, e)
        err = (got.double() - ref).abs().max().item()
        assert err <= 4 * (sgemm - ref.cpu()).abs().max().item() + 1e-9, (t, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_router_takes_the_pieces_at_prefill_sizes():
    from deepinfer_kernels.router_gemm import router_logits_bf16
    from types import SimpleNamespace

    from deepinfer_rt.layers.moe import ROUTER_PIECES_MIN_ROWS, Router

    config = SimpleNamespace(hidden_size=512, n_routed_experts=64, topk_method="greedy")
    router = Router(config).cuda()
    router.weight.data.normal_(0, 512**-0.5)
    assert router.weight_pieces is None
    router.process_weights_after_loading()
    x = torch.randn(ROUTER_PIECES_MIN_ROWS + 3, 512, device="cuda").bfloat16()
    got = router(x)
    assert torch.equal(got, router_logits_bf16(x, router.weight_pieces))
    torch.testing.assert_close(got, F.linear(x.float(), router.weight), rtol=1e-5, atol=1e-5)
    assert router.to(torch.bfloat16).weight_pieces is None and router.weight.dtype == torch.float32
