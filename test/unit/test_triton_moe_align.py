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


_PAIR_BLOCKS = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fused_moe import PER_PAIR_MAX, _block_m, moe_align_torch, pair_blocks
    g = torch.Generator().manual_seed(0)
    e = 16
    ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(4)])  # 16 pairs: one block each
    b = pair_blocks(ids, e)
    assert b.per_pair and b.num_blocks == 16 == PER_PAIR_MAX and b.block_m == _block_m(16, e)
    assert torch.equal(b.block_expert, ids.flatten())
    for t, block_m in ((40, None), (40, 32), (3, 32)):  # chosen by the pair count; fixed (batch-invariant mode)
        ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(t)])
        b = pair_blocks(ids, e, block_m)
        want_m = _block_m(ids.numel(), e) if block_m is None else block_m
        pairs, experts, used = moe_align_torch(ids, e, want_m)
        n = int(used)
        assert not b.per_pair and b.block_m == want_m and b.num_blocks == b.sorted_pairs.numel() // want_m
        assert torch.equal(b.sorted_pairs[:n].long(), pairs[:n].long()) and int(b.num_padded) == n
        rows = b.sorted_pairs[:n].long().view(-1, want_m)
        for blk, expert in zip(rows, b.block_expert[: n // want_m].tolist()):  # every block holds one expert's pairs
            real = blk[blk < ids.numel()]
            assert (ids.flatten()[real] == expert).all()
        assert sorted(b.sorted_pairs[:n][b.sorted_pairs[:n] < ids.numel()].tolist()) == list(range(ids.numel()))
    print("ok")
""")


def test_pair_blocks_per_pair_and_sorted():
    assert _interpret(_PAIR_BLOCKS).strip().endswith("ok")
