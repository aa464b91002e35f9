"""The MXFP4 MoE's "fp8" form (deepinfer_kernels.fused_moe_mxfp4_fp8) through Triton's interpreter on CPU.

- The placement: each nibble of every byte value, placed as e4m3 bits by _e4m3_codes, reads its e2m1 value x 2^-6
  exactly (both nibbles, all 256 bytes); the CUDA form's PTX does the same arithmetic four bytes at a time.
- The fused MoE against two references on the same MXFP4 weights: the dequantize-then-matmul one with the
  activations rounded to e4m3 per (row, 32 elements) as the form rounds them (x before gate_up, h before down),
  within the summation order (fp16 h: <= 2e-3 in norm; bf16 h, whose 8 bits move some of h's e4m3 roundings by a
  step: <= 5e-2), and the plain one, within the error of e4m3 activations (<= 0.12 in norm, 0.083-0.086
  measured; the 16-bit forms are within 1e-2). A wrong group scale gives errors of the order of the output. Sizes with K
  tails inside a tile (hidden and expert width 96: 3 groups), one block per pair and sorted routing, the clamp,
  bf16 and fp16.
"""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_fused_moe_mxfp4_group import EXPERTS  # noqa: E402
from test_triton_interpreted import _interpret  # noqa: E402

_PLACEMENT = textwrap.dedent("""
    import torch
    import triton
    import triton.language as tl
    from deepinfer_kernels.fused_moe_mxfp4_fp8 import _e4m3_codes
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4

    @triton.jit
    def place(B, O):
        offs = tl.arange(0, 256)
        b = tl.load(B + offs)
        tl.store(O + 2 * offs, _e4m3_codes(b, False, True))
        tl.store(O + 2 * offs + 1, _e4m3_codes(b, True, True))

    packed = torch.arange(256).to(torch.uint8).view(torch.int8)
    got = torch.zeros(512, dtype=torch.int8)
    place[(1,)](packed, got)
    want = dequantize_mxfp4(packed.view(1, 256), torch.full((1, 16), 127, dtype=torch.uint8).view(
        torch.float8_e8m0fnu), torch.float32).flatten()
    assert torch.equal(got.view(torch.float8_e4m3fn).float() * 64, want)
    print("ok")
""")

_MOE = EXPERTS + textwrap.dedent("""
    def e4m3_groups(x):  # per (row, 32 elements), as deepinfer_kernels.fp8_quant rounds them
        xg = x.float().view(x.shape[0], -1, 32)
        scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        return ((xg / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).view(x.shape)

    def reference(x, w, ids, limit, rounded):
        out = torch.zeros(x.shape[0], hidden)
        xr = e4m3_groups(x) if rounded else x.float()
        for j in range(ids.shape[1]):
            gate, up = torch.einsum("th,tnh->tn", xr, d_gu[ids[:, j]]).chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = (F.silu(gate) * up).to(x.dtype)
            h = e4m3_groups(h) if rounded else h.float()
            out += torch.einsum("ti,thi->th", h, d_down[ids[:, j]]) * w[:, j:j + 1]
        return out

    narrow = dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1, decode="fp8")  # a 32-wide K tail
    wide = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, decode="fp8")  # one tile, a group masked
    clamped = 0
    for dtype, t in ((torch.bfloat16, 3), (torch.float16, 20), (torch.bfloat16, 20)):
        x = torch.randn(t, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        rounded, plain = reference(x, w, ids, limit, True), reference(x, w, ids, limit, False)
        for config in (narrow, wide):
            y = fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, w, ids, limit, config=config)
            assert y.shape == (t, hidden) and y.dtype == dtype
            err = ((y.float() - rounded).norm() / rounded.norm()).item()
            # fp16 h keeps the rounding of x's reference; bf16 h (8 bits) moves some e4m3 roundings of h by a step
            assert err <= (2e-3 if dtype == torch.float16 else 5e-2), (dtype, t, config, err)
            err_plain = ((y.float() - plain).norm() / plain.norm()).item()
            assert err_plain <= 0.12, (dtype, t, config, err_plain)  # measured 0.083-0.086: e4m3 activations
        clamped += int((torch.einsum("th,nh->tn", x.float(), d_gu[0]).abs() > limit).sum())
    assert clamped > 0
    try:
        fused_moe_mxfp4(x.float(), q_gu, s_gu, qd, sd, w, ids, config=narrow)
    except ValueError as err:
        assert "takes bf16 / fp16" in str(err), err
    else:
        raise AssertionError("fp32 activations accepted by the fp8 form")
    print("ok")
""")


def test_e2m1_codes_placed_as_e4m3_bits_read_their_value():
    assert _interpret(_PLACEMENT).strip().endswith("ok")


def test_fp8_form_fused_moe_equals_dequantize_then_matmul():
    assert _interpret(_MOE).strip().endswith("ok")
