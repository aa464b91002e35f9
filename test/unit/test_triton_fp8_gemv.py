"""The FP8 GEMV form for a few rows (deepinfer_kernels.fp8_gemv) through Triton's interpreter on CPU, against the
W8A8 block GEMM's torch form (reference.fp8_block_gemm: the same per-token-group activation quantization, every
product and sum in fp32) at V4.1's 32 x 32 blocks, V3's 128 x 128 ones and a block wider than the default step,
with K splits, a K and an N off the tiles, a bias, per-row scales, and the refusals. The GPU suite runs it compiled (test/gpu/test_gpu_fp8.py).

Tolerance: the products are the same exact fp32 numbers, summed in another order: max error <= 1e-5 of the
output's max."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_GEMV = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fp8_gemv import fp8_gemv, gemv_split_for
    from deepinfer_kernels.reference import fp8_block_gemm as ref, quantize_fp8_blocks
    g = torch.Generator().manual_seed(0)
    cases = ((1, 200, 320, (32, 32), dict(BLOCK_N=32, KC=64)), (3, 96, 384, (128, 128), dict(BLOCK_N=16, KC=128)),
             (4, 70, 96, (32, 32), dict(BLOCK_N=32, KC=128)))
    for m, n, k, block, config in cases:
        w = torch.randn(n, k, generator=g) * 0.05
        w[:, :32] *= 20  # blocks of very different scales
        q, s = quantize_fp8_blocks(w, block)
        x = torch.randn(m, k + 8, generator=g)[:, 8:]  # strided rows
        x[0, 32:64] = 0  # a zero activation group
        bias = torch.randn(n, generator=g)
        want = ref(x, q, s, block)
        for split in (1, 2, 3):
            y = fp8_gemv(x, q, s, *block, config=config, split_k=split)
            assert y.shape == (m, n) and y.dtype == x.dtype
            assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (m, n, k, split)
            yb = fp8_gemv(x, q, s, *block, bias, config=config, split_k=split)
            assert (yb - want - bias).abs().max() <= 1e-5 * want.abs().max(), (m, n, k, split)
            # the activations quantized inside the GEMV kernel: the same products and sums, bit for bit
            assert torch.equal(fp8_gemv(x, q, s, *block, bias, config=config, split_k=split, quantize="kernel"), yb)
        rows = s.repeat_interleave(block[0], dim=0)[:n].contiguous()  # per-row scales (GROUP_N = 1)
        y1 = fp8_gemv(x, q, rows, 1, block[1], config=config, split_k=2)
        assert (y1 - want).abs().max() <= 1e-5 * want.abs().max()
        xb = x[:1].bfloat16()
        assert fp8_gemv(xb, q, s, *block, config=config).dtype == torch.bfloat16
        assert torch.equal(fp8_gemv(xb, q, s, *block, config=config, split_k=2, quantize="kernel"),
                           fp8_gemv(xb, q, s, *block, config=config, split_k=2))
    # grouped (block-diagonal, V4's wo_a form): each group's inputs quantized from its own columns
    # (several steps and splits a group); and a K ending inside a scale group (200 = 6 x 32 + 8)
    qg, sg = quantize_fp8_blocks(torch.randn(64, 512, generator=g), (32, 32))
    xg = torch.randn(2, 1024, generator=g)
    tile = dict(BLOCK_N=32, KC=64)
    for split in (1, 2, 3):
        assert torch.equal(fp8_gemv(xg, qg, sg, 32, 32, config=tile, groups=2, split_k=split, quantize="kernel"),
                           fp8_gemv(xg, qg, sg, 32, 32, config=tile, groups=2, split_k=split))
    qp, sp = quantize_fp8_blocks(torch.randn(40, 200, generator=g), (32, 32))
    xp = torch.randn(2, 200, generator=g)
    for split in (1, 2):
        assert torch.equal(fp8_gemv(xp, qp, sp, 32, 32, config=tile, split_k=split, quantize="kernel"),
                           fp8_gemv(xp, qp, sp, 32, 32, config=tile, split_k=split))
    q, s = quantize_fp8_blocks(torch.randn(64, 128, generator=g), (32, 32))
    for bad, message in ((dict(x=torch.randn(5, 128)), "at most 4 rows"), (dict(config=dict(BLOCK_N=32, KC=48)), "KC"),
                         (dict(s=s[:1]), "scales"), (dict(quantize="fused"), "quantize")):
        args = dict(x=torch.randn(1, 128), s=s, config=None, quantize=None) | bad
        try:
            fp8_gemv(args["x"], q, args["s"], 32, 32, config=args["config"], quantize=args["quantize"])
        except ValueError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"no ValueError for {message}")
    q5, s5 = quantize_fp8_blocks(torch.randn(40, 1024, generator=g), (128, 512))  # a block past the default step
    x5 = torch.randn(1, 1024, generator=g)
    want = ref(x5, q5, s5, (128, 512))
    assert (fp8_gemv(x5, q5, s5, 128, 512) - want).abs().max() <= 1e-5 * want.abs().max()
    assert gemv_split_for(1, 1280, 5120, 32, 256, 132) == 10  # 40 tiles: 13 wanted, 10 steps of two
    assert gemv_split_for(1, 32768, 1280, 32, 256, 132) == 1  # 1,024 tiles already
    print("ok")
""")


def test_fp8_gemv_matches_the_block_gemm_reference_in_the_interpreter():
    assert _interpret(_GEMV).strip().endswith("ok")
