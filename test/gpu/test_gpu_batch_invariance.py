"""Batch-invariant kernels and attention on CUDA: a row's result is bitwise the same alone and inside batches of
any size (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from deepinfer_kernels import reference
from deepinfer_rt.layers import methods
from deepinfer_rt.layers.kernel_config import KernelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

INVARIANT = KernelConfig(device_type="cuda", is_batch_invariant=True)  # the Triton batch-invariant kernels
LINEAR, ACT = methods.linear_method(INVARIANT), methods.activation_method(INVARIANT)
NORM, HEAD = methods.norm_method(INVARIANT), methods.head_matmul_method(INVARIANT)

_SIZES = (1, 3, 16, 17, 64, 129, 1000, 4096)


def _check_rows(fn, rows: torch.Tensor) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    alone = torch.cat([fn(rows[i : i + 1]) for i in range(len(rows))])
    for m in _SIZES:
        batch = torch.randn(m + len(rows), *rows.shape[1:], device="cuda", dtype=rows.dtype, generator=gen)
        at = m // 2
        batch[at : at + len(rows)] = rows
        assert torch.equal(fn(batch)[at : at + len(rows)], alone), f"batch of {m + len(rows)} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(2048, 5632), (7168, 1536), (576, 49152), (2048, 64), (2048, 576)])
def test_gpu_linear_rows_invariant_and_close(dtype, k, n):
    gen = torch.Generator(device="cuda").manual_seed(k)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)
    x = torch.randn(4, k, device="cuda", generator=gen).to(dtype)
    _check_rows(lambda t: LINEAR.linear(t, w), x)
    ref = torch.nn.functional.linear(x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(LINEAR.linear(x, w).float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_norm_and_silu_rows_invariant_and_close(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 4096, device="cuda", generator=gen).to(dtype)
    w = (torch.rand(4096, device="cuda", generator=gen) + 0.5).to(dtype)
    _check_rows(lambda t: NORM.rms_norm(t, w, 1e-6), x)
    _check_rows(ACT.silu_and_mul, x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(NORM.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), rtol=tol, atol=tol)
    torch.testing.assert_close(ACT.silu_and_mul(x), reference.silu_and_mul(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_head_matmul_rows_invariant_and_close(dtype):
    """MLA's absorbed per-head projections (16 heads, 128 -> 512 and back) in one launch, strided as the layer
    passes them."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    w_uk = (torch.randn(16, 128, 512, device="cuda", generator=gen) / 128**0.5).to(dtype)
    w_uv_t = (torch.randn(16, 128, 512, device="cuda", generator=gen) / 512**0.5).to(dtype).transpose(1, 2)
    q = torch.randn(4, 16, 192, device="cuda", generator=gen).to(dtype)[..., :128]
    o = torch.randn(4, 16, 512, device="cuda", generator=gen).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for x, w in ((q, w_uk), (o, w_uv_t)):
        _check_rows(lambda t: HEAD.apply(t, w), x)
        ref = torch.einsum("tha,hab->thb", x.double(), w.double())
        torch.testing.assert_close(HEAD.apply(x, w).double(), ref, rtol=tol, atol=tol)


def test_gpu_default_linear_is_not_batch_invariant():
    """cuBLAS picks kernels (and split-K) by shape: a row of F.linear changes with the batch size (on the H200,
    for this bf16 shape from 64 rows on; in fp32 from 2 rows on)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    w = torch.randn(1024, 8192, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(1, 8192, device="cuda", generator=gen, dtype=torch.bfloat16)
    alone = torch.nn.functional.linear(x, w)
    differs = False
    for m in _SIZES[1:]:
        batch = torch.randn(m, 8192, device="cuda", generator=gen, dtype=torch.bfloat16)
        batch[0] = x[0]
        differs |= not torch.equal(torch.nn.functional.linear(batch, w)[:1], alone)
    assert differs
