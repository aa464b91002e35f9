"""The one-launch MoE alignment kernel (deepinfer_kernels.moe_align) against the torch form, through Triton's
interpreter on CPU (the GPU suite runs it compiled)."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_ALIGN = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fused_moe import moe_align_torch
    from deepinfer_kernels.moe_align import moe_align
    cases = [(1, 6, 64, 16), (7, 6, 64, 16), (40, 2, 8, 32), (300, 8, 16, 64), (5, 4, 256, 16), (700, 6, 64, 32)]
    for seed, (t, k, e, block_m) in enumerate(cases):
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        if seed == 3:  # skewed: most pairs on two experts, several experts empty
            ids = torch.where(torch.rand(t, k, generator=g) < 0.8, ids % 2, ids)
        ref_pairs, ref_experts, ref_used = moe_align_torch(ids, e, block_m)
        pairs, experts, used = moe_align(ids, e, block_m)
        n = int(ref_used)
        assert int(used) == n, (seed, int(used), n)
        assert torch.equal(pairs[:n].long(), ref_pairs[:n].long()), seed
        assert torch.equal(experts[: n // block_m].long(), ref_experts[: n // block_m].long()), seed
    print("ok")
""")


def test_moe_align_kernel_equals_torch_form():
    assert _interpret(_ALIGN).strip().endswith("ok")
