"""The fused MXFP4 MoE (deepinfer_kernels.fused_moe_mxfp4) compiled on CUDA at DeepSeek-V4-Flash's expert shapes
(hidden 4096, expert width 2048, 256 experts, top-8), bf16 activations, 1 to 2048 tokens (skipped without a GPU).

- Against the bf16 fused MoE (deepinfer_kernels.fused_moe) on the same weights dequantized at load (plain SwiGLU):
  both multiply bf16 operands that are the same numbers (an e2m1 value x 2^e is exact in bf16) into fp32, and
  round h to bf16 between the GEMMs, so they differ by summation order and the rare h that rounds the other way:
  relative error <= MATCH_BF16 in norm.
- Against an fp32 torch reference (dequantize, then per-expert fp32 matmuls, V4's clamped SwiGLU at limit 10) at
  decode sizes: the kernel's bf16 h and bf16 output round at 2^-9: relative error <= MATCH_FP32 in norm.
Timings: benchmark/bench_kernels.py --only mxfp4.

    pytest test/gpu/test_gpu_mxfp4_moe.py -s
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

E, HIDDEN, INTER, TOP_K = 256, 4096, 2048, 8
MATCH_BF16 = 5e-3
MATCH_FP32 = 1e-2


@pytest.fixture(scope="module")
def experts():
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator(device="cuda").manual_seed(0)
    packed, dense = [], []
    for shape in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        q, s = zip(*(quantize_mxfp4(torch.randn(16, *shape, generator=g, device="cuda") * 0.02)
                     for _ in range(E // 16)))  # in slices: the fp32 intermediates of all 256 at once are 16 GB
        q, s = torch.cat(q), torch.cat(s)
        packed += [q, s]
        dense.append(torch.cat([dequantize_mxfp4(q[i : i + 16], s[i : i + 16], torch.bfloat16)
                                for i in range(0, E, 16)]))
    return packed, dense


def _route(t: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    weights, ids = torch.rand(t, E, generator=g, device="cuda").topk(TOP_K, dim=-1)
    return x, weights, ids


@pytest.mark.parametrize("t", [1, 7, 64, 256, 2048])
def test_matches_the_bf16_fused_moe_on_dequantized_weights(experts, t):
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_kernels.fused_moe_mxfp4 import fused_moe_mxfp4

    (q_gu, s_gu, qd, sd), (d_gu, d_down) = experts
    x, weights, ids = _route(t, t)
    got = fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, weights, ids).float()
    want = fused_moe(x, d_gu, d_down, weights, ids).float()
    err = ((got - want).norm() / want.norm()).item()
    print(f"T={t}: relative error {err:.2e} against the bf16 fused MoE")
    assert err <= MATCH_BF16


@pytest.mark.parametrize("t", [1, 16, 64])  # 64 tokens: the tl.dot_scaled row of the tile table
def test_matches_fp32_clamped_reference(experts, t):
    from deepinfer_kernels.fused_moe_mxfp4 import fused_moe_mxfp4

    (q_gu, s_gu, qd, sd), (d_gu, d_down) = experts
    x, weights, ids = _route(t, 100 + t)
    got = fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, weights, ids, swiglu_limit=10.0).float()
    want = torch.zeros(t, HIDDEN, device="cuda")
    for tok in range(t):
        for j in range(TOP_K):
            e = int(ids[tok, j])
            gate, up = (x[tok].float() @ d_gu[e].float().T).chunk(2)
            h = F.silu(gate.clamp(max=10.0)) * up.clamp(-10.0, 10.0)
            want[tok] += (h @ d_down[e].float().T) * weights[tok, j]
    err = ((got - want).norm() / want.norm()).item()
    print(f"T={t}: relative error {err:.2e} against fp32")
    assert err <= MATCH_FP32



@pytest.mark.parametrize("name", ["group_n32_k128", "group_n64_k256", "group_n64_k256_join",
                                  "group_n128_k128_w8", "group_n128_k256_w8", "group_n64_k128_w4_s5",
                                  "gemv_n32_k256", "gemv_n16_k512", "gemv_n64_k128", "gemv_n32_k512_w8",
                                  "scaled_n32_k128", "scaled_n64_k128", "scaled_n64_k256", "scaled_n128_k128_w8",
                                  "scaled_n128_k256_w8"])
@pytest.mark.parametrize("t", [1, 64, 300])
def test_every_benchmarked_configuration_matches_the_bf16_fused_moe(experts, name, t):
    """Each configuration bench_kernels.py --only mxfp4 times, compiled at V4-Flash
    shapes, against the bf16 fused MoE (as above)."""
    from deepinfer_kernels import fused_moe_mxfp4 as mx
    from deepinfer_kernels.fused_moe import fused_moe

    (q_gu, s_gu, qd, sd), (d_gu, d_down) = experts
    x, weights, ids = _route(t, 7 * t)
    config = mx.MXFP4_CANDIDATES[name]
    got = mx.fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, weights, ids, config=config).float()
    want = fused_moe(x, d_gu, d_down, weights, ids).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= MATCH_BF16, (name, t, err)
