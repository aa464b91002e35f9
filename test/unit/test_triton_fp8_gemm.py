"""The block-scaled W8A8 FP8 GEMM (deepinfer_kernels.fp8_gemm) through Triton's interpreter on CPU, against its
torch form (reference.fp8_block_gemm: the same per-token-group activation quantization, dequantize, fp32
matmul), and the Fp8BlockLinear method around it on a merged layer whose second shard starts inside a row
block (scales expanded per row). The GPU suite (test/gpu/test_gpu_fp8.py) runs the kernel compiled.

Tolerance: both sides quantize the activations identically (the interpreter path rounds to e4m3's grid in fp32,
see the kernel) and every product is exact, so they differ by fp32 summation order only: max error <= 1e-5 of
the output's max. Against the unquantized x @ dequant(w).T the activations' e4m3 rounding (3 mantissa bits)
leaves a relative error of a few percent (checked <= 6% in norm)."""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_GEMM = textwrap.dedent("""
    import torch
    import deepinfer_kernels.fp8_gemm as fp8_gemm_module
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, fp8_block_gemm as ref, quantize_fp8_blocks
    g = torch.Generator().manual_seed(0)
    for m, n, k, bm, bn in ((1, 200, 256, 16, 32), (17, 96, 384, 16, 64), (33, 130, 200, 32, 32)):
        w = torch.randn(n, k, generator=g) * 0.05
        w[:, :128] *= 20  # blocks of very different scales
        q, s = quantize_fp8_blocks(w)
        x = torch.randn(m, k + 8, generator=g)[:, 8:]  # strided rows
        x[0, 128:] = 0  # a zero activation group
        bias = torch.randn(n, generator=g)
        y = fp8_block_gemm(x, q, s, 128, 128, bias, config=dict(BLOCK_M=bm, BLOCK_N=bn))
        want = ref(x, q, s) + bias
        assert y.shape == (m, n) and y.dtype == x.dtype
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), (m, n, k)
        exact = x @ dequantize_fp8_blocks(q, s).t() + bias
        assert (y - exact).norm() <= 0.06 * exact.norm()
        # Per-row scales (GROUP_N = 1) give the same product.
        rows = s.repeat_interleave(128, dim=0)[:n].contiguous()
        y1 = fp8_block_gemm(x, q, rows, 1, 128, bias, config=dict(BLOCK_M=bm, BLOCK_N=bn))
        assert (y1 - y).abs().max() <= 1e-5 * want.abs().max()
        # K split over programs (fp32 partial sums added in split order by a second kernel): the same sum.
        for split in (2, 3):
            ys = fp8_block_gemm(x, q, s, 128, 128, bias, config=dict(BLOCK_M=bm, BLOCK_N=bn), split_k=split)
            assert (ys - want).abs().max() <= 1e-5 * want.abs().max(), (m, n, k, split)
            # Added by each tile's last split instead of a second kernel: the same bits, the counters back at 0.
            for b in (bias, None):
                two = fp8_block_gemm(x, q, s, 128, 128, b, config=dict(BLOCK_M=bm, BLOCK_N=bn), split_k=split)
                one = fp8_block_gemm(x, q, s, 128, 128, b, config=dict(BLOCK_M=bm, BLOCK_N=bn), split_k=split,
                                     split_sum="last_program")
                assert torch.equal(one, two), (m, n, k, split)
            assert not fp8_gemm_module._tile_counters(x.device).any()
    from deepinfer_kernels.fp8_gemm import split_k_for
    assert split_k_for(1, 2048, 2048, 16, 32, 128, 132) == 8  # 64 tiles, 16 K blocks
    assert split_k_for(1, 2048, 256, 16, 32, 128, 132) == 1  # two K blocks: no split of one block each
    assert split_k_for(17, 2048, 2048, 16, 32, 128, 132) == 1  # more rows than SPLIT_K_MAX_ROWS
    print("ok")
""")

_LINEAR = textwrap.dedent("""
    import torch
    from deepinfer_kernels.reference import fp8_block_gemm as ref, quantize_fp8_blocks
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.linear import MergedLinear
    g = torch.Generator().manual_seed(1)
    sizes = {"q": 192, "kv_a": 168}  # kv_a starts mid-block
    wq, wkv = torch.randn(192, 256, generator=g), torch.randn(168, 256, generator=g)
    (qq, sq), (qkv, skv) = quantize_fp8_blocks(wq), quantize_fp8_blocks(wkv)
    x = torch.randn(5, 256, generator=g)
    want = torch.cat([ref(x, qq, sq), ref(x, qkv, skv)], dim=-1)
    for quantized in (True, False):
        config = KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=quantized)
        with build_context(config):
            layer = MergedLinear(256, sizes)
        assert isinstance(layer.method, Fp8BlockLinear)
        if quantized:  # the release format: fp8 values and scales, shard by shard
            assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.shape == (4, 2)
            for shard, (q, s) in (("q", (qq, sq)), ("kv_a", (qkv, skv))):
                layer.weight.weight_loader(layer.weight, q, shard)
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, s, shard)
            try:
                layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, torch.ones(1, 2), "kv_a")
                raise AssertionError("a wrong scale shape loaded")
            except ValueError as e:
                assert "(1, 2) != (2, 2)" in str(e)
        else:  # 16/32-bit weights, quantized at load
            with torch.no_grad():
                layer.weight.weight_loader(layer.weight, wq, "q")
                layer.weight.weight_loader(layer.weight, wkv, "kv_a")
        layer = layer.to(torch.float32)  # a cast keeps the fp8 weight and the fp32 scales
        layer.process_weights_after_loading()
        assert layer.weight.dtype == torch.float8_e4m3fn and layer.scale_group_n == 1
        assert layer.weight_scale_inv.shape == (360, 2)
        y = layer(x)
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), quantized
    print("ok")
""")


def test_fp8_block_gemm_matches_dequantized_matmul():
    assert _interpret(_GEMM).strip().endswith("ok")


@pytest.mark.parametrize("path", ["triton", "tiled"])
def test_fp8_block_linear_merged_shards_off_block_boundary(path, monkeypatch):
    """Through the fused kernel (DEEPINFER_FP8_GEMM=triton) and the quantize-once tiled GEMM (=tiled, which `auto`,
    the default, runs off CUDA)."""
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", path)
    assert _interpret(_LINEAR + f"assert layer.method.gemm_path == {path!r}\n").strip().endswith("ok")


def test_fp8_gemm_switch_refuses_unknown_path(monkeypatch):
    monkeypatch.setenv("DEEPINFER_FP8_GEMM", "cutlass")
    from deepinfer_rt.layers.fp8 import weight_linear_method
    from deepinfer_rt.layers.kernel_config import KernelConfig

    with pytest.raises(ValueError, match="DEEPINFER_FP8_GEMM='cutlass': not one of triton, scaled_mm, tiled, gemv, "
                                         "w16, dequant, auto"):
        weight_linear_method(KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=True))
