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


FRAG_CONFIGS = {"n64_w4": None, "n64_w4_in_step": dict(BLOCK_N=64, num_warps=4, num_stages=3, AHEAD=False),
                "n128_w4": dict(BLOCK_N=128, num_warps=4, num_stages=3),
                "n128_w4_ahead": dict(BLOCK_N=128, num_warps=4, num_stages=3, AHEAD=True),
                "n128_w8": dict(BLOCK_N=128, num_warps=8, num_stages=3),
                "n64_m16": dict(BLOCK_N=64, num_warps=4, num_stages=3, BLOCK_M=16)}


@pytest.fixture(scope="module")
def fragment(experts):
    from deepinfer_kernels.fused_moe_mxfp4_frag import fast_scales, repack_fragment, repack_scales

    (q_gu, s_gu, qd, sd), _ = experts
    assert fast_scales(s_gu, sd)  # 0.02-scaled weights: scale bytes near 2^-8
    return repack_fragment(q_gu), repack_scales(s_gu), repack_fragment(qd), repack_scales(sd)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("config", list(FRAG_CONFIGS))
@pytest.mark.parametrize("t", [1, 7, 64, 300, 2048])
def test_fragment_order_matches_the_bf16_fused_moe(experts, fragment, t, config, fast):
    """deepinfer_kernels.fused_moe_mxfp4_frag over the repacked experts (both decodes: the one-multiply FAST one
    and the two-multiply one for scale bytes past 128; scales loaded a step ahead and in the step) against the bf16
    fused MoE, as above."""
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_kernels.fused_moe_mxfp4_frag import fused_moe_mxfp4_frag

    _, (d_gu, d_down) = experts
    x, weights, ids = _route(t, 11 * t)
    got = fused_moe_mxfp4_frag(x, *fragment, weights, ids, fast=fast, config=FRAG_CONFIGS[config]).float()
    want = fused_moe(x, d_gu, d_down, weights, ids).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err <= MATCH_BF16, (t, config, fast, err)


def test_fragment_order_with_large_scales():
    """Scale bytes past 128 (weights of magnitude ~2^10): the two-multiply decode against the dequantized weights,
    and every e2m1 code (random bytes) through the bf16 bit placement."""
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_kernels.fused_moe_mxfp4_frag import fast_scales, fused_moe_mxfp4_frag, repack_fragment, repack_scales
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4

    g = torch.Generator(device="cuda").manual_seed(5)
    e, hidden, inter = 8, 512, 256
    q_gu = torch.randint(-128, 128, (e, 2 * inter, hidden // 2), generator=g, device="cuda", dtype=torch.int8)
    qd = torch.randint(-128, 128, (e, hidden, inter // 2), generator=g, device="cuda", dtype=torch.int8)
    s_gu = torch.randint(110, 125, (e, 2 * inter, hidden // 32), generator=g, device="cuda", dtype=torch.uint8)
    sd = torch.randint(125, 140, (e, hidden, inter // 32), generator=g, device="cuda", dtype=torch.uint8)
    assert not fast_scales(s_gu, sd)
    x = torch.randn(33, hidden, generator=g, device="cuda").to(torch.bfloat16) * 0.01
    weights, ids = torch.rand(33, e, generator=g, device="cuda").topk(2, dim=-1)
    got = fused_moe_mxfp4_frag(x, repack_fragment(q_gu), repack_scales(s_gu), repack_fragment(qd), repack_scales(sd),
                               weights, ids, fast=False)
    want = fused_moe(x, dequantize_mxfp4(q_gu, s_gu, torch.bfloat16), dequantize_mxfp4(qd, sd, torch.bfloat16),
                     weights, ids)
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err <= MATCH_BF16, err


def test_clamped_experts_repack_into_the_fragment_order_at_load():
    """DeepSeek-V4's routed experts built for CUDA from an MXFP4 checkpoint: with the fragment order (the default)
    process_weights_after_loading reorders the packed bytes and the scales in place and the forward runs
    fused_moe_mxfp4_frag;
    without it, fused_moe_mxfp4 over the release order. Same checkpoint tensors, same routing, same outputs
    (MATCH_BF16)."""
    import types

    from deepinfer_rt.config import QuantConfig
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_kernels.fused_moe_mxfp4_frag import repack_fragment, repack_scales
    from deepinfer_rt.layers.quant_formats import quantize_mxfp4
    from deepinfer_rt.models.deepseek_v4.moe import ClampedExperts

    g = torch.Generator().manual_seed(3)
    cfg = types.SimpleNamespace(n_routed_experts=4, hidden_size=256, moe_intermediate_size=128, swiglu_limit=7.0)
    quant = QuantConfig("fp8", (32, 32), "ue8m0", "fp4")
    (q_gu, s_gu), (qd, sd) = (quantize_mxfp4(torch.randn(4, *shape, generator=g) * 0.1)
                              for shape in ((256, 256), (256, 128)))
    x = torch.randn(21, 256, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(21)]).cuda()
    w = torch.rand(21, 2, generator=g).cuda()
    out = {}
    for fragment in (True, False):
        with build_context(KernelConfig(device_type="cuda").for_checkpoint(quant)):
            experts = ClampedExperts(cfg)
        experts.weights_method.fragment = fragment
        params = dict(experts.named_parameters())
        for name, t in (("gate_up_proj", q_gu), ("gate_up_proj_scale_inv", s_gu), ("down_proj", qd),
                        ("down_proj_scale_inv", sd)):
            params[name].weight_loader(params[name], t)
        experts = experts.to("cuda", torch.bfloat16)
        experts.process_weights_after_loading()
        experts.process_weights_after_loading()  # a second finalize leaves the repacked bytes alone
        assert (experts.mxfp4_fast is True) is fragment, experts.mxfp4_fast
        want_q, want_s = (repack_fragment(q_gu), repack_scales(s_gu)) if fragment else (q_gu, s_gu)
        assert torch.equal(experts.gate_up_proj.cpu(), want_q.view(torch.int8))
        assert torch.equal(experts.gate_up_proj_scale_inv.cpu().view(torch.uint8), want_s.view(torch.uint8))
        out[fragment] = experts(x, w, ids).float()
    err = ((out[True] - out[False]).norm() / out[False].norm()).item()
    assert err <= MATCH_BF16, err
