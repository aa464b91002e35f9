"""The grouped (block-diagonal) FP8 GEMM (deepinfer_kernels.fp8_gemm, `groups=`; V4's grouped output projection
wo_a kept in FP8) through Triton's interpreter on CPU. The GPU suite (test/gpu/test_gpu_fp8.py) runs it compiled.

- Each path's grouped launch equals, bit for bit, the same path run on one group at a time (the group's columns of
  x copied out, its weight rows and scale rows sliced): the same tiles, the same K steps, the same sums (the GEMV
  form, deepinfer_kernels.fp8_gemv, too, at up to 4 rows).
- Against reference.fp8_block_gemm per group: max error <= 1e-5 of the output's max (exact products, fp32 sums in
  another order), at 128 x 128 and 32 x 32 scale blocks, groups whose rows straddle a scale block, split K.
- Refusals: a group of fewer than 16 rows (or not a multiple of 16), shapes that do not make the groups."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_GROUPED = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm, fp8_gemm, fp8_invariant_gemm, group_tile_n
    from deepinfer_kernels.reference import fp8_block_gemm as ref, quantize_fp8_blocks
    g = torch.Generator().manual_seed(3)
    # (tokens, groups, rows a group, K, scale block)
    for m, groups, rows, k, block in ((1, 3, 48, 256, (128, 128)), (5, 2, 256, 384, (128, 128)),
                                      (18, 4, 32, 128, (32, 32)), (3, 2, 16, 64, (32, 32))):
        n = groups * rows
        w = torch.randn(n, k, generator=g) * 0.05
        w[: n // 2, : block[1]] *= 30  # blocks of very different scales
        q, s = quantize_fp8_blocks(w, block)
        x = torch.randn(m, groups, k, generator=g)
        x[:, -1] *= 50  # a group of its own activation scale
        want = torch.cat([ref(x[:, i], q[i * rows:(i + 1) * rows], s[i * rows // block[0]:], block)[:, :rows]
                          if rows % block[0] == 0 else
                          ref(x[:, i], q, s, block)[:, i * rows:(i + 1) * rows] for i in range(groups)], dim=1)

        def per_group(fn):
            outs = []
            for i in range(groups):
                wi = q[i * rows:(i + 1) * rows]
                si = s.repeat_interleave(block[0], dim=0)[i * rows:(i + 1) * rows].contiguous()
                outs.append(fn(x[:, i].contiguous(), wi, si, 1))
            return torch.cat(outs, dim=1)

        rows_scale = s.repeat_interleave(block[0], dim=0)[:n].contiguous()  # per-row scales: slices per group
        x2 = x.reshape(m, groups * k)
        tile = dict(BLOCK_M=16, BLOCK_N=group_tile_n(64, rows), num_warps=4, num_stages=2)
        for split in (1, 2):
            y = fp8_block_gemm(x2, q, rows_scale, 1, block[1], config=tile, split_k=split, groups=groups)
            mine = per_group(lambda xi, wi, si, gn: fp8_block_gemm(xi, wi, si, gn, block[1], config=tile,
                                                                   split_k=split))
            assert torch.equal(y, mine), (m, groups, rows, k, split)
            assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (m, groups, rows, k, split)
        # block scales as loaded (GROUP_N = block rows), each path of the switch
        for path in ("triton", "tiled", "gemv", "auto"):  # (an explicit scaled_mm is refused off CUDA)
            y = fp8_gemm(x2, q, s, block[0], block[1], path=path, groups=groups)
            assert y.shape == (m, n) and (y - want).abs().max() <= 1e-5 * want.abs().max(), (path, m, rows)
        if m <= 4:  # the GEMV form (deepinfer_kernels.fp8_gemv): grouped = group by group, bit for bit
            from deepinfer_kernels.fp8_gemv import fp8_gemv
            y = fp8_gemv(x2, q, rows_scale, 1, block[1], groups=groups, split_k=2)
            assert torch.equal(y, per_group(lambda xi, wi, si, gn: fp8_gemv(xi, wi, si, gn, block[1], split_k=2)))
        tiled = fp8_gemm(x2, q, rows_scale, 1, block[1], path="tiled", groups=groups)
        assert torch.equal(tiled, per_group(lambda xi, wi, si, gn: fp8_gemm(xi, wi, si, gn, block[1], path="tiled")))
        inv = fp8_invariant_gemm(x2, q, rows_scale, 1, block[1], groups=groups)
        assert torch.equal(inv, per_group(lambda xi, wi, si, gn: fp8_invariant_gemm(xi, wi, si, gn, block[1])))
        assert torch.equal(fp8_invariant_gemm(x2[:1], q, rows_scale, 1, block[1], groups=groups), inv[:1])
    # refusals
    q, s = quantize_fp8_blocks(torch.randn(48, 128, generator=g), (32, 32))
    for groups, cols in ((2, 256), (3, 384)):  # 24 / 16 rows a group: 24 is not a multiple of 16
        try:
            fp8_block_gemm(torch.randn(2, cols), q, s, 32, 32, groups=groups)
            assert groups == 3
        except ValueError as e:
            assert groups == 2 and "multiple of 16" in str(e), e
    for bad in (torch.randn(2, 300), torch.randn(2, 128 * 5)):
        try:
            fp8_gemm(bad, q, s, 32, 32, groups=3, path="tiled")
            raise AssertionError("shapes that make no groups were taken")
        except ValueError as e:
            assert "groups" in str(e), e
    print("ok")
""")

_APPLY = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fp8_gemm import fp8_gemm
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear
    from deepinfer_rt.layers.linear import Linear
    torch.manual_seed(0)
    groups, rows, k = 2, 16, 128
    assert not Fp8BlockLinear((32, 32), is_checkpoint_quantized=False).takes_groups(rows, k)  # V4.1's blocks
    method = Fp8BlockLinear((128, 128), is_checkpoint_quantized=False)
    layer = Linear(k, groups * rows, method=method)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    layer.process_weights_after_loading()  # quantized at load: float8 weight, 128 x 128 block scales
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.scale_group_n == 128
    assert method.takes_groups(rows, k) and not method.takes_groups(8, k) and not method.takes_groups(rows, 64)
    x = torch.randn(3, groups, k)
    y = method.apply_grouped(layer, x)
    want = torch.stack([fp8_gemm(x[:, g].contiguous(), layer.weight[g * rows:(g + 1) * rows],
                                 layer.weight_scale_inv.repeat_interleave(128, dim=0)[g * rows:(g + 1) * rows].contiguous(),
                                 1, 128) for g in range(groups)], dim=1)
    assert y.shape == (3, groups, rows) and (y - want).abs().max() <= 1e-5 * want.abs().max()
    print("ok")
""")


def test_fp8_linear_apply_grouped():
    """Fp8BlockLinear.apply_grouped (what GroupedLinear runs on CUDA) through the interpreter: (T, G, K) in, (T, G,
    R) out, each group its weight rows' product; takes_groups refuses groups under 16 rows, inputs off the block and
    32 x 32 blocks."""
    assert _interpret(_APPLY).strip().endswith("ok")


def test_grouped_fp8_gemm_equals_per_group_and_reference():
    assert _interpret(_GROUPED).strip().endswith("ok")
