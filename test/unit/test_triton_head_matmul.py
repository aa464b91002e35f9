"""The batch-invariant per-head matmul kernel (MLA's absorbed projections on CUDA) through Triton's
interpreter on CPU: a row's result is bitwise the same alone and inside batches of other sizes, with strided
inputs as the MLA layer passes them, and close to einsum. The GPU suite runs it compiled."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_HEAD_MATMUL = textwrap.dedent("""
    import torch
    from deepinfer_kernels.batch_invariant import head_matmul
    g = torch.Generator().manual_seed(0)
    h, a, b = 3, 40, 24
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        w = (torch.randn(h, b, a, generator=g) / a**0.5).to(dtype).transpose(1, 2)  # (H, A, B), strided
        x = torch.randn(3, h, a + 8, generator=g).to(dtype)[..., 8:]  # (T, H, A), strided rows
        alone = torch.cat([head_matmul(x[i : i + 1], w) for i in range(3)])
        for t in (4, 70, 131):
            batch = torch.randn(t, h, a + 8, generator=g).to(dtype)[..., 8:]
            at = (t - 3) // 2
            batch[at : at + 3] = x
            assert torch.equal(head_matmul(batch, w)[at : at + 3], alone), (dtype, t)
        ref = torch.einsum("tha,hab->thb", x.double(), w.double())
        torch.testing.assert_close(alone.double(), ref, rtol=tol, atol=tol)
    print("ok")
""")


def test_head_matmul_rows_invariant_and_close():
    assert _interpret(_HEAD_MATMUL).strip().endswith("ok")
