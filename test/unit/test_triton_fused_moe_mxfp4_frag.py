"""The fragment-order MXFP4 MoE (deepinfer_kernels.fused_moe_mxfp4_frag): the repack's bit placement decoded back
by the kernel's own shifts and masks (torch) gives every code's value; through Triton's interpreter the kernel over
repacked experts equals dequantize-then-matmul at bf16 tolerance, with scale bytes past FAST_MAX_SCALE (the
two-multiply decode), one-block-per-pair and sorted routing, 64-row tiles with the scales loaded a step ahead and
in the step, 128-row tiles, 16-pair row blocks; the repacked scales are the weights' tiles; bad shapes are
refused. The GPU suite
runs it at V4-Flash shapes (test/gpu/test_gpu_mxfp4_moe.py).

Tolerance: the dequantized weights are exact in bf16; h is rounded to bf16 between the GEMMs and the activations
are bf16 (the fp32 reference keeps h unrounded): <= 1e-2 in norm.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _decode_words(words: torch.Tensor) -> torch.Tensor:
    """int64 words (..., 16) -> (..., 16, 4 slots, 2 halves) values x 2^126, as _frag_tile's masks read them."""
    m = 0x81C081C0
    o = [words & m, (words << 3) & m, (words << 6) & m,
         ((words << 1) & 0x80008000) | ((words >> 5) & 0x01000100) | ((words >> 4) & 0x00C000C0)]
    halves = [[(x >> (16 * p)) & 0xFFFF for p in (0, 1)] for x in o]
    bits = torch.stack([torch.stack(h, -1) for h in halves], -2)  # (..., 16, 4, 2) 16-bit patterns
    sign = torch.where(bits & 0x8000 != 0, -1.0, 1.0)
    field = (bits >> 6) & 7  # exponent bits 2-1, mantissa bit 0 of the e2m1 code
    return sign * E2M1[field]


def _untile(t: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """The tiled layout (TILE_ROWS rows x row_bytes per chunk, the chunks of a row block in a row) -> rows."""
    e, r, n = t.shape
    return t.reshape(e, r // 64, n // row_bytes, 64, row_bytes).transpose(2, 3).reshape(e, r, n)


def test_repack_places_every_code_where_the_masks_read_it():
    from deepinfer_kernels.fused_moe_mxfp4_frag import TILE_ROWS, fragment_order, repack_fragment

    assert TILE_ROWS == 64
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (3, 128, 256 // 2), generator=g, dtype=torch.int8)
    packed[0, 0, :8] = torch.tensor([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], dtype=torch.uint8).view(
        torch.int8)  # every code once
    frag = repack_fragment(packed, max_elements=1 << 15)  # several expert steps
    inplace = packed.clone()
    assert repack_fragment(inplace, out=inplace, max_elements=1 << 15) is inplace and torch.equal(inplace, frag)
    assert frag.shape == packed.shape and frag.dtype == torch.int8
    assert not torch.equal(frag[0, 1, :64], _untile(frag, 64)[0, 1, :64])  # row 1's first chunk is not at row 1
    u = packed.view(torch.uint8).long()
    codes = torch.stack([u & 15, u >> 4], -1).reshape(3, 128, 2, 128)  # element order, 2 chunks a row
    want = torch.where(codes >= 8, -1.0, 1.0) * E2M1[codes & 7]
    words = _untile(frag, 64).view(torch.int32).long() & 0xFFFFFFFF
    got = _decode_words(words.reshape(3, 128, 2, 16))  # (3, 128, chunks, 16, 4, 2)
    order = fragment_order().flatten()
    assert torch.equal(got.reshape(3, 128, 2, 128), want[..., order])
    assert sorted(order.tolist()) == list(range(128))  # a permutation of the chunk
    with pytest.raises(ValueError, match="multiple of 128"):
        repack_fragment(packed[..., :48])
    with pytest.raises(ValueError, match="rows = 96"):
        repack_fragment(packed[:, :96])


def test_repack_scales_tiles_them_like_the_weights():
    from deepinfer_kernels.fused_moe_mxfp4_frag import repack_scales

    g = torch.Generator().manual_seed(1)
    scale = torch.randint(0, 256, (2, 192, 16), generator=g, dtype=torch.uint8)  # 3 row blocks, 4 chunks
    tiled = repack_scales(scale)
    assert tiled.shape == scale.shape and torch.equal(_untile(tiled, 4), scale)
    assert torch.equal(tiled[0, 0, :8], torch.cat([scale[0, 0, :4], scale[0, 1, :4]]))  # rows 0, 1 of chunk 0
    e8m0 = scale.view(torch.float8_e8m0fnu).clone()
    assert repack_scales(e8m0, out=e8m0) is e8m0 and torch.equal(e8m0.view(torch.uint8), tiled)  # in place
    with pytest.raises(ValueError, match="rows = 96"):
        repack_scales(scale[:, :96])


_KERNEL = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from deepinfer_kernels.fused_moe_mxfp4_frag import fast_scales, fused_moe_mxfp4_frag, repack_fragment, repack_scales
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4, quantize_mxfp4
    g = torch.Generator().manual_seed(0)
    e, hidden, inter, k, limit = 4, 128, 256, 2, 0.3
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) * 0.05
    gate_up[:, :, :32] *= 10  # groups of very different scales
    down = torch.randn(e, hidden, inter, generator=g) * 0.05
    down[1] *= 2.0 ** 10  # scale bytes past 128: the two-multiply decode
    (q_gu, s_gu), (qd, sd) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    d_gu, d_down = dequantize_mxfp4(q_gu, s_gu), dequantize_mxfp4(qd, sd)
    f_gu, f_d = repack_fragment(q_gu), repack_fragment(qd)
    assert fast_scales(s_gu) and not fast_scales(s_gu, sd)
    s_gu, sd = repack_scales(s_gu), repack_scales(sd)

    def reference(x, w, ids, limit):
        out = torch.zeros(x.shape[0], hidden)
        for j in range(ids.shape[1]):
            gu = torch.einsum("th,tnh->tn", x.float(), d_gu[ids[:, j]])
            gate, up = gu.chunk(2, dim=-1)
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = F.silu(gate) * up
            out += torch.einsum("ti,thi->th", h, d_down[ids[:, j]]) * w[:, j:j + 1]
        return out

    # 64-row tiles with the next chunk's scales loaded ahead (the default) and in the step; 128-row tiles; 16-pair
    # row blocks where the default rule takes 32 (an expert's 20-odd pairs in two blocks)
    for t, config in ((3, None), (5, dict(BLOCK_N=64, num_warps=4, num_stages=1, AHEAD=False)),
                      (40, dict(BLOCK_N=128, num_warps=4, num_stages=1)), (40, dict(BLOCK_M=16))):
        x = torch.randn(t, hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        want = reference(x, w, ids, limit)
        y = fused_moe_mxfp4_frag(x, f_gu, s_gu, f_d, sd, w, ids, limit, fast=False, config=config)
        assert y.shape == (t, hidden) and y.dtype == torch.bfloat16
        diff = y.float() - want
        assert diff.norm() <= 1e-2 * want.norm(), (t, (diff.norm() / want.norm()).item())
        # FAST over experts whose scales allow it: every expert but the scaled-up one
        keep = ids != 1
        ids2 = torch.where(keep, ids, 0)
        y = fused_moe_mxfp4_frag(x, f_gu, s_gu, f_d, sd, w, ids2, limit, fast=True, config=config)
        want2 = reference(x, w, ids2, limit)
        assert (y.float() - want2).norm() <= 1e-2 * want2.norm()
    x = torch.randn(2, hidden, generator=g).bfloat16()
    ids = torch.zeros(2, k, dtype=torch.long)
    for bad, message in ((dict(x=x.float()), "bf16"), (dict(config=dict(BLOCK_N=48, num_warps=4)), "BLOCK_N")):
        args = dict(x=x, config=None) | bad
        try:
            fused_moe_mxfp4_frag(args["x"], f_gu, s_gu, f_d, sd, torch.ones(2, k), ids, config=args["config"])
        except ValueError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"no ValueError for {message}")
    print("ok")
""")


def test_fragment_moe_matches_dequantized_reference_in_the_interpreter():
    assert _interpret(_KERNEL).strip().endswith("ok")


def test_tile_choice_by_pairs_and_row_blocks():
    from deepinfer_kernels.fused_moe_mxfp4_frag import FRAG_TILES, WIDE_TILES, _frag_tiles, fragment_supported

    assert _frag_tiles(8, 16) == FRAG_TILES and _frag_tiles(2048, 16) == FRAG_TILES
    assert _frag_tiles(16384, 64) == WIDE_TILES  # 2,048 tokens of top-8: the 128-row tiles
    assert _frag_tiles(65536, 128) == FRAG_TILES  # blocks of 128 pairs: 128-row tiles would spill
    assert fragment_supported(2048, 4096) and not fragment_supported(192, 4096) and not fragment_supported(256, 96)
    # row blocks: one a pair up to PER_PAIR_MAX pairs, 16 pairs below 8 pairs an expert (256 tokens of top-6 over
    # 256 experts), fused_moe's rule from there on (2,048 tokens)
    from deepinfer_kernels.fused_moe import PER_PAIR_MAX
    from deepinfer_kernels.fused_moe_mxfp4_frag import _block_m

    assert _block_m(PER_PAIR_MAX, 256) is None and _block_m(PER_PAIR_MAX + 1, 256) == _block_m(1536, 256) == 16
    assert _block_m(2048, 256) is None and _block_m(12288, 256) is None
