"""The activation quantizer (deepinfer_kernels.fp8_quant) and the GEMMs over its output (fp8_gemm's tiled path,
the path switch) through Triton's interpreter on CPU. The GPU suite (test/gpu/test_gpu_fp8.py) runs them compiled.

- The quantizer gives the values of the torch reference (reference.quantize_fp8_token_groups) bit for bit, and
  those of the fused kernel's in-kernel quantization: through an identity weight with unit scales the fused kernel
  returns q(x) x s(x) per element (one nonzero product per output), which must equal the quantizer's q x s exactly.
- The tiled GEMM against reference.fp8_block_gemm: the same quantized operands, exact products, fp32 sums in
  another order: max error <= 1e-5 of the output's max (as the fused kernel's interpreter test)."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_QUANT = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm
    from deepinfer_kernels.fp8_quant import quantize_fp8_token_groups
    from deepinfer_kernels.reference import expand_block_scales, quantize_fp8_token_groups as ref
    g = torch.Generator().manual_seed(0)
    for m, k, pad in ((1, 256, 4), (19, 384, 4), (33, 200, 1)):
        x = torch.randn(m, k + 8, generator=g)[:, 8:] * 3  # strided rows
        x[0, 128:256] = 0  # a zero group
        x[-1, :5] = 1e4  # a group of a very different scale
        q, s = quantize_fp8_token_groups(x, 128, pad)
        m_pad = -(-m // pad) * pad
        groups = -(-k // 128)
        assert q.shape == (m_pad, k) and q.dtype == torch.float8_e4m3fn
        assert s.shape == (m_pad, groups) and s.stride() == (1, m_pad) and s.dtype == torch.float32
        want_q, want_s = ref(x, 128)
        assert torch.equal(s[:m], want_s), (m, k)
        assert torch.equal(q[:m].view(torch.uint8), want_q.view(torch.uint8)), (m, k)
        assert not q[m:].float().any()  # padded rows are zeros
        # The fused kernel's own quantization, read out through an identity weight with unit scales.
        if k % 128 == 0:
            eye = torch.eye(k).to(torch.float8_e4m3fn)
            ones = torch.ones(k // 128, k // 128)
            fused = fp8_block_gemm(x, eye, ones, 128, 128, config=dict(BLOCK_M=16, BLOCK_N=64))
            mine = q[:m].float() * expand_block_scales(s[:m], (m, k), (1, 128))
            assert torch.equal(fused, mine), (m, k)
    print("ok")
""")

_TILED = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fp8_gemm import fp8_gemm, fp8_tiled_gemm, m_bucket, auto_path, FP8_GEMM_PATHS
    from deepinfer_kernels.fp8_quant import quantize_fp8_token_groups
    from deepinfer_kernels.reference import fp8_block_gemm as ref, quantize_fp8_blocks
    g = torch.Generator().manual_seed(1)
    for m, n, k, bm, bn in ((1, 200, 256, 16, 64), (37, 96, 384, 16, 32), (40, 260, 200, 32, 128)):
        w = torch.randn(n, k, generator=g) * 0.05
        w[:, :128] *= 20  # blocks of very different scales
        q, s = quantize_fp8_blocks(w)
        x = torch.randn(m, k, generator=g)
        bias = torch.randn(n, generator=g)
        want = ref(x, q, s) + bias
        xq, xs = quantize_fp8_token_groups(x, 128, 4)  # padded rows are not read
        config = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=2)
        y = fp8_tiled_gemm(xq, xs, m, q, s, 128, 128, x.dtype, bias, config=config)
        assert y.shape == (m, n) and y.dtype == x.dtype
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (m, n, k)
        rows = s.repeat_interleave(128, dim=0)[:n].contiguous()  # per-row scales (GROUP_N = 1)
        y1 = fp8_tiled_gemm(xq, xs, m, q, rows, 1, 128, x.dtype, bias, config=config)
        assert (y1 - want).abs().max() <= 1e-5 * want.abs().max(), (m, n, k)
    # 32 x 32 blocks (V4.1's): four blocks a step, K past the last whole step (224 = 128 + 96; 200 cuts a block),
    # the same sums in the same order as one block a step
    for m, n, k in ((3, 72, 224), (18, 40, 200)):
        w = torch.randn(n, k, generator=g) * 0.05
        w[:32, 32:64] *= 40
        q, s = quantize_fp8_blocks(w, (32, 32))
        x = torch.randn(m, k, generator=g)
        want = ref(x, q, s, (32, 32))
        xq, xs = quantize_fp8_token_groups(x, 32)
        config = dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2)
        y = fp8_tiled_gemm(xq, xs, m, q, s, 32, 32, x.dtype, config=config)
        one = fp8_tiled_gemm(xq, xs, m, q, s, 32, 32, x.dtype, config=config, k_step=32)
        assert torch.equal(y, one), (m, n, k)
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (m, n, k)
        # w16 (deepinfer_kernels.fp8_w16): the weight dequantized in registers, the activations as they are
        from deepinfer_kernels.fp8_w16 import INTERPRETER_TILE, fp8_w16_gemm
        from deepinfer_kernels.reference import dequantize_fp8_blocks
        bias = torch.randn(n, generator=g)
        exact = x @ dequantize_fp8_blocks(q, s, (32, 32)).T + bias
        w16 = fp8_gemm(x.view(1, m, k), q, s, 32, 32, bias, path="w16")
        assert w16.shape == (1, m, n) and (w16[0] - exact).abs().max() <= 1e-5 * exact.abs().max(), (m, n, k)
        assert torch.equal(fp8_gemm(x, q, s, 32, 32, path="w16", groups=1), fp8_gemm(x, q, s, 32, 32, path="w16"))
        wide = fp8_w16_gemm(x, q, s, 32, 32, bias, config=dict(INTERPRETER_TILE, WIDE=True))  # one dot a step
        assert (wide - exact).abs().max() <= 1e-5 * exact.abs().max(), (m, n, k)
        # dequant (deepinfer_kernels.fp8_dequant): the whole weight dequantized, then torch's GEMM; the weight it
        # writes is the reference's bit for bit (fp32 scales of very different sizes above)
        from deepinfer_kernels.fp8_dequant import dequantize_fp8_weight
        assert torch.equal(dequantize_fp8_weight(q, s, 32, 32, torch.float32), dequantize_fp8_blocks(q, s, (32, 32)))
        dq = fp8_gemm(x.view(1, m, k), q, s, 32, 32, bias, path="dequant")
        dense = dequantize_fp8_blocks(q, s, (32, 32))
        assert dq.shape == (1, m, n) and torch.equal(dq[0], torch.nn.functional.linear(x, dense, bias)), (m, n, k)
        assert (dq[0] - exact).abs().max() <= 1e-5 * exact.abs().max(), (m, n, k)
        e8m0 = torch.exp2(torch.round(torch.log2(s)))  # the releases' power-of-two scales: bf16 holds every product
        assert torch.equal(dequantize_fp8_weight(q, e8m0, 32, 32, torch.bfloat16),
                           dequantize_fp8_blocks(q, e8m0, (32, 32), torch.bfloat16))
        try:
            dequantize_fp8_weight(q, s[:, :-1], 32, 32, torch.float32)
            raise AssertionError("a scale grid short of the weight's blocks was taken")
        except ValueError as e:
            assert "scales" in str(e)
    # dequantize_fp8_weight at other blocks: 128 x 128 with N and K off the tile, a block wider than the tile, rows
    # of their own scale (GROUP_N = 1)
    from deepinfer_kernels.fp8_dequant import dequantize_fp8_weight
    for n, k, block in ((200, 400, (128, 128)), (40, 1024, (128, 512)), (33, 96, (1, 32))):
        q, s = quantize_fp8_blocks(torch.randn(n, k, generator=g), block)
        assert torch.equal(dequantize_fp8_weight(q, s, *block, torch.float32), dequantize_fp8_blocks(q, s, block))
    # The switch: `auto` by default (the GEMV form at one row, the split fused kernel at <= 16 rows and N <= 4096,
    # else scaled_mm, tiled where scaled_mm cannot run), a clear refusal of an explicit scaled_mm off CUDA and of an
    # unknown path.
    assert FP8_GEMM_PATHS == ("triton", "scaled_mm", "tiled", "gemv", "w16", "dequant", "auto")
    assert auto_path(1) == auto_path(1, 2048) == auto_path(1, 2048, (32, 32)) == "gemv"
    assert auto_path(2) == auto_path(10**6) == "scaled_mm"
    # the split fused kernel for few rows and narrow outputs at 128 x 128 blocks (measured on an H100)
    assert auto_path(2, 2048) == auto_path(16, 4096) == "triton"
    assert auto_path(17, 2048) == "scaled_mm" and auto_path(2, 2048, (32, 32)) == auto_path(256, 1, (32, 32)) == "w16"
    assert auto_path(257, 1, (32, 32)) == "scaled_mm"  # prefill sizes: not timed with w16 (scaled_mm -> tiled)
    assert auto_path(64, 2048, split_rows=64) == "triton" and auto_path(65, 2048, split_rows=64) == "scaled_mm"
    x = torch.randn(2, 3, 256, generator=g)
    q, s = quantize_fp8_blocks(torch.randn(128, 256, generator=g))
    assert torch.equal(fp8_gemm(x, q, s, 128, 128, path="auto"), fp8_gemm(x, q, s, 128, 128))
    # gemv: the GEMV form up to its row limit; more rows, or a grouped GEMM, take auto's path
    from deepinfer_kernels.fp8_gemv import fp8_gemv
    assert torch.equal(fp8_gemm(x[0, :2], q, s, 128, 128, path="gemv"), fp8_gemv(x[0, :2], q, s, 128, 128))
    assert torch.equal(fp8_gemm(x, q, s, 128, 128, path="gemv"), fp8_gemm(x, q, s, 128, 128))
    # auto asks auto_path with the GEMM's rows, output width, blocks and split row limit, and runs what it answers
    import deepinfer_kernels.fp8_gemm as module
    asked, inner = [], module.auto_path
    module.auto_path = lambda *a: asked.append(a) or inner(*a)
    assert torch.equal(fp8_gemm(x, q, s, 128, 128), fp8_gemm(x, q, s, 128, 128, path="triton"))
    module.auto_path = inner
    assert asked == [(6, 128, (128, 128), module.SPLIT_K_MAX_ROWS)]
    for path, error in (("scaled_mm", RuntimeError), ("cutlass", ValueError)):
        try:
            fp8_gemm(x, q, s, 128, 128, path=path)
            raise AssertionError(path)
        except error as e:
            assert ("CUDA" in str(e) or "scaled_mm" in str(e)) if path == "scaled_mm" else "cutlass" in str(e)
    assert [m_bucket(m) for m in (1, 16, 17, 64, 65, 2048, 4096, 4097, 10**6)] == [16, 16, 64, 64, 256, 4096,
                                                                                  4096, 8192, 8192]
    print("ok")
""")


def test_quantizer_matches_reference_and_fused_kernel_bitwise():
    assert _interpret(_QUANT).strip().endswith("ok")


def test_tiled_gemm_matches_reference_and_path_switch():
    assert _interpret(_TILED).strip().endswith("ok")
