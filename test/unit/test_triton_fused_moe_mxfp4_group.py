"""The group-tiled MXFP4 decode (deepinfer_kernels.fused_moe_mxfp4._mx_group_tile: e8m0 scales loaded once per
32 elements, e2m1 codes placed as fp16 bits) and the tl.dot_scaled form ("scaled") through Triton's interpreter on
CPU.

- The decode alone: every byte value (both nibbles) under every e8m0 exponent 0..240 equals
  layers/quant_formats.py dequantize_mxfp4 bit for bit in fp32, and in fp16 where the value is finite in fp16.
- The fused MoE on the group path, two dots and one (JOIN) over the re-interleaved tile, against
  dequantize-then-matmul: odd sizes (hidden 96 = 3 groups, so a K tail inside 64- and 128-wide K tiles; expert
  width 96, not a multiple of BLOCK_N 64), one-block-per-pair and sorted routing, the clamp reached, fp32
  (<= 1e-5 of the output's max: summation order only), fp16 and bf16 (h rounded between the GEMMs: <= 2e-3 / 1e-2
  in norm), the default tiles (_tiles), the tl.dot_scaled form (16-bit only) and the GEMV form (one program row
  per pair, fp32 on the CUDA cores) on the same inputs; bad decode options refused.
- The tile table's choice of form, and its fallback where Triton lacks tl.dot_scaled's fast_math.
"""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_DECODE = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl
    from deepinfer_kernels.fused_moe_mxfp4 import _mx_group_tile
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4

    @triton.jit
    def decode(W, S, O, n_rows, K, G: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr):
        offs_n = tl.arange(0, BLOCK_N)
        offs_g = tl.arange(0, G)
        nmask = offs_n < n_rows
        byte = (offs_g[:, None] * 16 + tl.arange(0, 16)[None, :])[:, :, None]
        lo, hi = _mx_group_tile(W + offs_n[None, None, :] * (K // 2) + byte,
                                S + offs_n[None, :] * (K // 32) + offs_g[:, None], offs_g < K // 32, nmask, DTYPE)
        out = O + offs_n[None, None, :] * K + 2 * byte
        mask = nmask[None, None, :] & (byte >= 0)
        tl.store(out, lo, mask=mask)
        tl.store(out + 1, hi, mask=mask)

    g = torch.Generator().manual_seed(0)
    n, k = 241, 64  # row r: exponent r for its first group, a common one (100..149) for its second
    packed = torch.arange(n * k // 2).remainder(256).to(torch.uint8).view(torch.int8).view(n, k // 2)
    assert packed.unique().numel() == 256
    scale = torch.stack([torch.arange(n), torch.randint(100, 150, (n,), generator=g)], 1).to(torch.uint8)
    for dtype, tl_dtype in ((torch.float32, tl.float32), (torch.float16, tl.float16)):
        got = torch.zeros(n, k, dtype=dtype)
        decode[(1,)](packed, scale, got, n, k, G=2, BLOCK_N=256, DTYPE=tl_dtype)
        want = dequantize_mxfp4(packed, scale.view(torch.float8_e8m0fnu), dtype)
        finite = want.isfinite()
        assert finite.float().mean() > 0.7
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(got.view(bits)[finite], want.view(bits)[finite]), dtype
    print("ok")
""")

_MOE = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from deepinfer_kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4, quantize_mxfp4
    g = torch.Generator().manual_seed(0)
    e, hidden, inter, k, limit = 4, 96, 96, 2, 0.3
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) * 0.05
    gate_up[:, :, :32] *= 10  # groups of very different scales
    down = torch.randn(e, hidden, inter, generator=g) * 0.05
    down[:, ::3] *= 0.01
    (q_gu, s_gu), (qd, sd) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    d_gu, d_down = dequantize_mxfp4(q_gu, s_gu), dequantize_mxfp4(qd, sd)

    def reference(x, w, ids, limit):
        out = torch.zeros(x.shape[0], hidden)
        for j in range(ids.shape[1]):
            gate, up = torch.einsum("th,tnh->tn", x.float(), d_gu[ids[:, j]]).chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out += torch.einsum("ti,thi->th", F.silu(gate) * up, d_down[ids[:, j]]) * w[:, j:j + 1]
        return out

    def check(y, want, dtype):
        diff = y.float() - want
        if dtype == torch.float32:
            assert diff.abs().max() <= 1e-5 * want.abs().max(), diff.abs().max().item()
        else:
            tol = 2e-3 if dtype == torch.float16 else 1e-2
            assert diff.norm() <= tol * want.norm(), (diff.norm() / want.norm()).item()

    two_dots = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1, decode="group", JOIN=False)
    joined = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, decode="group", JOIN=True)
    gemv = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1, decode="gemv")  # K tail: a 32-wide last tile
    gemv_wide = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=1, decode="gemv")  # one tile, groups masked
    scaled = dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=1, decode="scaled")  # tl.dot_scaled, K tail
    scaled_wide = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=1, decode="scaled")
    clamped = 0
    for dtype, t, lim, configs in ((torch.float32, 3, limit, (two_dots, joined, None, gemv, gemv_wide)),
                                   (torch.float32, 9, None, (joined, gemv)),
                                   (torch.float16, 20, limit, (joined, gemv_wide, None, scaled, scaled_wide)),
                                   (torch.bfloat16, 6, limit, (scaled, scaled_wide))):
        x = torch.randn(t, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        want = reference(x, w, ids, lim)
        for config in configs:
            y = fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, w, ids, lim, config=config)
            assert y.shape == (t, hidden) and y.dtype == dtype
            check(y, want, dtype)
        if lim is not None:
            clamped += int((torch.einsum("th,nh->tn", x.float(), d_gu[0]).abs() > lim).sum())
    assert clamped > 0  # the limit was reached, so the clamp was exercised
    x, w, ids = x[:3].float(), w[:3], ids[:3]
    for bad, message in ((dict(decode="lut"), "decode must be"), (dict(scaled, JOIN=True), "JOIN needs"),
                         (dict(gemv, JOIN=True), "JOIN needs"), (scaled, "takes bf16 / fp16"),
                         (dict(two_dots, BLOCK_K=96), "power of two")):
        try:
            fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, w, ids, config=dict(two_dots, **bad))
        except ValueError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"{message}: accepted")
    print("ok")
""")


def test_group_decode_is_exact_for_every_byte_and_exponent():
    assert _interpret(_DECODE).strip().endswith("ok")


def test_group_decode_fused_moe_equals_dequantize_then_matmul():
    assert _interpret(_MOE).strip().endswith("ok")


def test_tile_table_falls_back_to_the_group_decode_without_dot_scaled(monkeypatch):
    """16-bit launches above the GEMV rows take tl.dot_scaled; a Triton without its fast_math (< 3.3) gets the hand
    group decode instead; fp32 always keeps the group decode (tl.dot_scaled takes no fp32 operand)."""
    import torch

    from deepinfer_kernels import fused_moe_mxfp4 as mx

    assert mx._tiles(8, torch.bfloat16)["decode"] == "gemv"
    assert mx._tiles(16, torch.bfloat16)["decode"] == ("scaled" if mx.HAS_DOT_SCALED else "group")
    assert mx._tiles(4096, torch.float32)["decode"] == "group"
    monkeypatch.setattr(mx, "HAS_DOT_SCALED", True)
    assert mx._tiles(512, torch.bfloat16)["decode"] == "scaled"
    monkeypatch.setattr(mx, "HAS_DOT_SCALED", False)
    assert mx._tiles(512, torch.bfloat16) == mx.GROUP_TILES
