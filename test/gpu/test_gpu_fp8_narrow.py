"""FP8 linears with few rows on CUDA (skipped without a GPU): the CUDA-core GEMV form (deepinfer_kernels.fp8_gemv) and
the W8A16 kernel (deepinfer_kernels.fp8_w16, `auto`'s path for V4.1's 32 x 32 blocks at 2-256 rows), each against
the tiled path or the dequantized weight; every tile the W8A16 autotuner may pick; fp32 activations in fp32
products. The W8A8 block GEMM's own tests, and rel_err, are in test_gpu_fp8.py.

    pytest test/gpu/test_gpu_fp8_narrow.py -s
"""
from __future__ import annotations

import pytest
import torch

from test_gpu_fp8 import DEV, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


GEMV_SHAPES = {"v41_wq_a": (1280, 5120, (32, 32)), "v41_wq_b": (32768, 1280, (32, 32)),
               "v41_shared_down": (5120, 2304, (32, 32)), "v2lite_o_proj": (2048, 2048, (128, 128)),
               "partial": (1000, 1312, (32, 32))}


@pytest.mark.parametrize("shape", list(GEMV_SHAPES), ids=list(GEMV_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 4])
def test_fp8_gemv_against_reference_and_tiled_path(shape, m):
    """deepinfer_kernels.fp8_gemv (the CUDA-core form for a few rows; K split, default tiles) against the tiled path
    and the torch form at V4.1-Flash's 32 x 32 blocks and V2-Lite's 128 x 128 ones, with a bias at two rows. Against
    the tiled path (the same quantized activations and exact products, fp32 sums in another order, one bf16
    rounding each): <= 1e-3 in norm (at most 7.7e-5 measured on an H100). Against the torch form both paths differ
    alike, by the quantizer's rare e4m3 neighbours (above): 5.3e-3 for each at V2-Lite's o_proj with these inputs,
    so <= 6e-3 here."""
    from deepinfer_kernels.fp8_gemm import fp8_gemm
    from deepinfer_kernels.fp8_gemv import fp8_gemv
    from deepinfer_kernels.reference import fp8_block_gemm as ref_gemm, quantize_fp8_blocks

    n, k, block = GEMV_SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(m * 11 + n)
    q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02, block)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    bias = torch.randn(n, device=DEV, generator=g).bfloat16() if m == 2 else None
    y = fp8_gemv(x, q, s, *block, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    want = ref_gemm(x.float(), q, s, block) + (bias.float() if bias is not None else 0)
    tiled = fp8_gemm(x, q, s, *block, bias, path="tiled")
    print(f"\n{shape} m={m}: gemv {rel_err(y, want):.2e} tiled {rel_err(tiled, want):.2e} against the torch form, "
          f"gemv against tiled {rel_err(y, tiled):.2e}")
    assert rel_err(y, tiled) <= 1e-3
    assert rel_err(y, want) <= 6e-3
    # the activations quantized inside the GEMV kernel: the same products and sums as the separate launch
    assert torch.equal(fp8_gemv(x, q, s, *block, bias, quantize="kernel"), fp8_gemv(x, q, s, *block, bias,
                                                                                    quantize="launch"))


@pytest.mark.parametrize("shape", list(GEMV_SHAPES), ids=list(GEMV_SHAPES))
@pytest.mark.parametrize("m", [2, 16, 64, 256])
def test_fp8_w16_against_dequantized_weight(shape, m):
    """deepinfer_kernels.fp8_w16 (the weight tile dequantized in registers, bf16 activations as they are) against
    the bf16 activations times the fp32 dequantized weight: the dequantized tile rounds to bf16 (these test scales
    are not powers of two; e8m0 ones are exact), fp32 sums, one bf16 rounding of the output: <= 4e-3 in norm."""
    from deepinfer_kernels.fp8_gemm import fp8_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

    n, k, block = GEMV_SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(m * 13 + n)
    q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02, block)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    bias = torch.randn(n, device=DEV, generator=g).bfloat16() if m == 16 else None
    y = fp8_gemm(x, q, s, *block, bias, path="w16")
    want = x.float() @ dequantize_fp8_blocks(q, s, block).float().T + (bias.float() if bias is not None else 0)
    print(f"\n{shape} m={m}: w16 {rel_err(y, want):.2e}")
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and rel_err(y, want) <= 4e-3


def _w16_config_ids():
    from deepinfer_kernels.fp8_w16 import W16_CONFIGS

    return [f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_M']}w{c.num_warps}{'_wide' if c.kwargs['WIDE'] else ''}"
            for c in W16_CONFIGS]


@pytest.mark.parametrize("index", range(len(_w16_config_ids())), ids=_w16_config_ids())
def test_fp8_w16_every_tile(index):
    """Each tile the W8A16 autotuner may pick (the autotuned test above runs only the winner), over a shape whose
    K and N end mid-step and mid-block (partial): the same bound against the dequantized weight."""
    from deepinfer_kernels.fp8_w16 import W16_CONFIGS, fp8_w16_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

    c = W16_CONFIGS[index]
    n, k, block = GEMV_SHAPES["partial"]
    g = torch.Generator(device=DEV).manual_seed(index)
    q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02, block)
    x = torch.randn(70, k, device=DEV, generator=g).bfloat16()
    y = fp8_w16_gemm(x, q, s, *block, config=dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages))
    want = x.float() @ dequantize_fp8_blocks(q, s, block).float().T
    assert rel_err(y, want) <= 4e-3


@pytest.mark.parametrize("m", [2, 64, 256])
def test_fp8_w16_fp32_activations_take_fp32_products(m):
    """fp32 activations (the fp32 engine; V4.1's 32 x 32 blocks take w16 at 2-256 rows) multiply in fp32, not TF32:
    within fp32 summation order of the dequantized product (TF32 would miss by ~1e-3)."""
    from deepinfer_kernels.fp8_gemm import fp8_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

    n, k, block = GEMV_SHAPES["partial"]
    g = torch.Generator(device=DEV).manual_seed(m)
    q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02, block)
    x = torch.randn(m, k, device=DEV, generator=g)
    y = fp8_gemm(x, q, s, *block, path="auto")
    want = (x.double() @ dequantize_fp8_blocks(q, s, block).double().T).float()
    assert y.dtype == torch.float32 and rel_err(y, want) <= 1e-5


@pytest.mark.parametrize("shape", ["v41_wq_b", "v41_shared_down", "partial"])
@pytest.mark.parametrize("m", [2, 256, 2048])
def test_fp8_dequant_path_against_dequantized_weight(shape, m):
    """deepinfer_kernels.fp8_dequant (the whole weight dequantized into scratch, then cuBLAS): the scratch weight is
    the reference's bit for bit (fp32 scales, rounded once to bf16; power-of-two (e8m0) scales, exact), so the
    product is torch's bf16 GEMM on the dequantized weight; against fp32 products the same 4e-3 bound as w16."""
    from deepinfer_kernels.fp8_dequant import dequantize_fp8_weight
    from deepinfer_kernels.fp8_gemm import fp8_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

    n, k, block = GEMV_SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(m * 7 + n)
    q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02, block)
    # fp32 scales (V3's): one rounding to bf16 each, to nearest even as torch's cast
    assert torch.equal(dequantize_fp8_weight(q, s, *block, torch.bfloat16),
                       dequantize_fp8_blocks(q, s, block, torch.bfloat16))
    s = torch.exp2(torch.round(torch.log2(s)))
    dense = dequantize_fp8_blocks(q, s, block, torch.bfloat16)
    assert torch.equal(dequantize_fp8_weight(q, s, *block, torch.bfloat16), dense)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    bias = torch.randn(n, device=DEV, generator=g).bfloat16() if m == 2 else None
    y = fp8_gemm(x, q, s, *block, bias, path="dequant")
    assert torch.equal(y, torch.nn.functional.linear(x, dense, bias))
    want = x.float() @ dense.float().T + (bias.float() if bias is not None else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and rel_err(y, want) <= 4e-3
