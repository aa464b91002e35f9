"""The FP8 fused MoE (deepinfer_kernels.fused_moe_fp8) through Triton's interpreter on CPU against its torch form
(reference.fused_moe_fp8), with widths that end inside a scale block (intermediate 200 = 1.56 blocks of 128,
hidden 160), sorted blocks and one-block-per-pair routing, fp32 and fp16 activations. The GPU suite runs the
kernel compiled (see the GPU checks listed with it).

Tolerance: both sides quantize the same activations the same way and every product is exact, so in fp32 they
differ by summation order only (max error <= 1e-5 of the output's max). In fp16 an h within an fp32 rounding
error of an fp16 rounding boundary rounds differently on the two sides, which moves its group's amax or flips
its e4m3 code (one step, 6%) now and then: <= 1% in norm there. Against the unquantized path (x @ dequantized
weights, h unquantized) the activations' e4m3 rounding leaves a few percent (<= 8% in norm).
"""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_FUSED_MOE_FP8 = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8
    from deepinfer_kernels.reference import dequantize_fp8_blocks, fused_moe_fp8 as ref, quantize_fp8_blocks
    g = torch.Generator().manual_seed(0)
    e, hidden, inter, k = 4, 160, 200, 2
    gate, up = torch.randn(e, inter, hidden, generator=g) * 0.05, torch.randn(e, inter, hidden, generator=g) * 0.05
    gate[:, :, :128] *= 10  # blocks of very different scales
    down = torch.randn(e, hidden, inter, generator=g) * 0.05
    (qg, sg), (qu, su), (qd, sd) = (quantize_fp8_blocks(w) for w in (gate, up, down))
    q_gu, s_gu = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
    for dtype, t in ((torch.float32, 5), (torch.float32, 40), (torch.float16, 40)):
        x = torch.randn(t, hidden, generator=g).to(dtype)
        x[0, 128:] = 0  # a zero activation group
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        y = fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids, config=dict(BLOCK_N=32, num_warps=4, num_stages=1))
        want = ref(x, q_gu, s_gu, qd, sd, w, ids)
        assert y.shape == (t, hidden) and y.dtype == dtype
        diff, want = y.float() - want.float(), want.float()
        if dtype == torch.float32:
            assert diff.abs().max() <= 1e-5 * want.abs().max(), (t, diff.abs().max().item())
        else:
            assert diff.norm() <= 0.01 * want.norm(), (t, (diff.norm() / want.norm()).item())
        dg, du, dd = (dequantize_fp8_blocks(q, s) for q, s in ((qg, sg), (qu, su), (qd, sd)))
        xf = x.float()
        exact = torch.zeros(t, hidden)
        for j in range(k):
            a, b = torch.einsum("th,tih->ti", xf, dg[ids[:, j]]), torch.einsum("th,tih->ti", xf, du[ids[:, j]])
            exact += torch.einsum("ti,thi->th", a * torch.sigmoid(a) * b, dd[ids[:, j]]) * w[:, j:j + 1]
        assert (y.float() - exact).norm() <= 0.08 * exact.norm(), (dtype, t)
    try:
        fused_moe_fp8(x, q_gu, s_gu[:, 1:].contiguous(), qd, sd, w, ids)
    except ValueError as err:
        assert "128x128 blocks" in str(err)
    else:
        raise AssertionError("a scale grid of the wrong shape was accepted")
    print("ok")
""")


# RoutedExperts built for CUDA with FP8 (is_fp8_fused_experts) keep float8 weights through a cast, load a release
# checkpoint's tensors or quantize 16/32-bit ones at load to the same, and run the kernel (here interpreted).
_ROUTED_EXPERTS_FP8 = textwrap.dedent("""
    import torch
    from deepinfer_kernels.reference import fused_moe_fp8 as ref, quantize_fp8_blocks
    from deepinfer_rt.layers.fp8 import Fp8BlockExperts
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.moe import Fp8FusedExperts, RoutedExperts
    g = torch.Generator().manual_seed(1)
    e, hidden, inter = 3, 160, 136
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(e, hidden, inter, generator=g) * 0.1
    (qg, sg), (qu, su) = quantize_fp8_blocks(gate_up[:, :inter]), quantize_fp8_blocks(gate_up[:, inter:])
    q_gu, s_gu = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
    qd, sd = quantize_fp8_blocks(down)
    x = torch.randn(9, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    want = ref(x, q_gu, s_gu, qd, sd, w, ids)
    for from_checkpoint in (True, False):
        config = KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=from_checkpoint)
        with build_context(config):
            experts = RoutedExperts(e, hidden, inter)
        assert isinstance(experts.method, Fp8FusedExperts) and isinstance(experts.weights_method, Fp8BlockExperts)
        if from_checkpoint:
            for name, t in (("gate_up_proj", q_gu), ("down_proj", qd), ("gate_up_proj_scale_inv", s_gu),
                            ("down_proj_scale_inv", sd)):
                p = getattr(experts, name)
                p.weight_loader(p, t)
            try:
                experts.gate_up_proj.weight_loader(experts.gate_up_proj, gate_up.bfloat16())
            except ValueError as err:
                assert "bfloat16 weight" in str(err)
            else:
                raise AssertionError("a bf16 expert weight was taken for FP8")
        else:
            experts.gate_up_proj.data.copy_(gate_up)
            experts.down_proj.data.copy_(down)
        experts = experts.to(torch.float32)
        experts.process_weights_after_loading()
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale_inv.dtype == torch.float32
        assert torch.equal(experts.gate_up_proj_scale_inv, s_gu) and torch.equal(experts.down_proj_scale_inv, sd)
        assert torch.equal(experts.gate_up_proj.float(), q_gu.float())
        y = experts(x, w, ids)
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), from_checkpoint
    print("ok")
""")


def test_routed_experts_keep_fp8_and_run_the_kernel():
    assert _interpret(_ROUTED_EXPERTS_FP8).strip().endswith("ok")


def test_fused_moe_fp8_equals_torch_form():
    assert _interpret(_FUSED_MOE_FP8).strip().endswith("ok")


# Batch-invariant mode keeps FP8 weights: the fused MoE with its one configuration and the tiled GEMM with its one
# tile give each token the same bits alone and inside batches of other tokens, and the methods a batch-invariant
# CUDA config builds take them.
_INVARIANT_FP8 = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fp8_gemm import fp8_invariant_gemm
    from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8
    from deepinfer_kernels.reference import fp8_block_gemm as ref_gemm, fused_moe_fp8 as ref, quantize_fp8_blocks
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear, weight_linear_method
    from deepinfer_rt.layers.kernel_config import KernelConfig
    from deepinfer_rt.layers.moe import Fp8FusedExperts, experts_method
    g = torch.Generator().manual_seed(3)
    e, hidden, inter, k, t = 6, 160, 200, 2, 40
    gate, up = torch.randn(e, inter, hidden, generator=g) * 0.05, torch.randn(e, inter, hidden, generator=g) * 0.05
    down = torch.randn(e, hidden, inter, generator=g) * 0.05
    (qg, sg), (qu, su), (qd, sd) = (quantize_fp8_blocks(w) for w in (gate, up, down))
    q_gu, s_gu = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
    x = torch.randn(t, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    full = fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids, batch_invariant=True)
    want = ref(x, q_gu, s_gu, qd, sd, w, ids)
    assert (full - want).abs().max() <= 1e-5 * want.abs().max()
    for rows in ([0], [5, 17], list(range(3, 40, 3))):
        part = fused_moe_fp8(x[rows], q_gu, s_gu, qd, sd, w[rows], ids[rows], batch_invariant=True)
        assert torch.equal(part, full[rows]), rows
    qw, sw = quantize_fp8_blocks(torch.randn(200, hidden, generator=g) * 0.05)
    bias = torch.randn(200, generator=g)
    y = fp8_invariant_gemm(x, qw, sw, 128, 128, bias)
    want = ref_gemm(x, qw, sw) + bias
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    for rows in ([0], [5, 17], list(range(1, 40, 2))):
        assert torch.equal(fp8_invariant_gemm(x[rows], qw, sw, 128, 128, bias), y[rows]), rows
    config = KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=True,
                          is_batch_invariant=True)
    linear, experts = weight_linear_method(config), experts_method(config)
    assert isinstance(linear, Fp8BlockLinear) and linear.is_batch_invariant
    assert isinstance(experts, Fp8FusedExperts) and experts.is_batch_invariant
    print("ok")
""")


def test_batch_invariant_fp8_moe_and_gemm_bitwise_in_any_batch():
    assert _interpret(_INVARIANT_FP8).strip().endswith("ok")



# FP8 shared experts join the routed ones (MoE.process_weights_after_loading, joint_fp8_expert_weights): the shared
# MLP cut in two experts of one scale block each, scales with them; the routed tensors become views of the joint
# ones; one fused launch then gives what the routed launch plus the shared MLP's FP8 GEMMs give (the same
# activation groups on both sides: a block of the shared width is one expert's). Beyond FUSED_SHARED_MAX_TOKENS rows
# the shared MLP runs apart; a width that would cut a scale block keeps the experts apart.
_JOINT_FP8 = textwrap.dedent("""
    import torch
    from deepinfer_rt.config import ModelConfig
    from deepinfer_rt.layers import moe as moe_module
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.moe import MoE
    from deepinfer_rt.models.loader import finalize

    def build(inter):
        config = ModelConfig(architecture="DeepseekV2ForCausalLM", vocab_size=32, hidden_size=256,
                             intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                             rms_norm_eps=1e-6, max_position=64, tie_word_embeddings=False, eos_token_ids=(0,),
                             bos_token_id=None, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
                             moe_intermediate_size=inter)
        with build_context(KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=False)):
            moe = MoE(config)
        gen = torch.Generator().manual_seed(inter)
        for p in moe.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        return finalize(moe), gen

    moe, gen = build(128)
    gate_up, gate_up_s, down, down_s = moe.joint_experts
    assert gate_up.shape == (6, 256, 256) and gate_up_s.shape == (6, 2, 2) and down_s.shape == (6, 2, 1)
    assert moe.experts.gate_up_proj.data_ptr() == gate_up.data_ptr()
    assert moe.experts.down_proj_scale_inv.data_ptr() == down_s.data_ptr()
    x = torch.randn(3, 256, generator=gen)
    joint = moe(x)
    moe_module.FUSED_SHARED_MAX_TOKENS = 2  # 3 rows: the routed launch, then the shared MLP's FP8 GEMMs
    apart = moe(x)
    assert (joint - apart).abs().max() <= 1e-5 * apart.abs().max(), (joint - apart).abs().max().item()
    assert moe.shared_experts(x).abs().max() > 0.1 * apart.abs().max()  # the shared part counts
    moe_module.FUSED_SHARED_MAX_TOKENS = 512
    uneven, _ = build(192)  # 1.5 scale blocks an expert: kept apart
    assert uneven.joint_experts is None
    print("ok")
""")


def test_fp8_shared_experts_join_the_routed_launch():
    assert _interpret(_JOINT_FP8).strip().endswith("ok")


# The TILED layout (tile_experts: 64-row x 128-input tiles contiguous) reorders bytes only: the kernels read the same
# weights in the same K order, so their outputs equal the row layout's bit for bit; shapes it cannot tile are refused.
_TILED_FP8 = textwrap.dedent("""
    import pytest
    import torch
    from deepinfer_kernels.fused_moe_fp8 import TILE_ROWS, fused_moe_fp8, tile_experts, tiles_supported
    from deepinfer_kernels.reference import quantize_fp8_blocks
    g = torch.Generator().manual_seed(5)
    e, hidden, inter, k, t = 3, 256, 256, 2, 12  # two K steps of down too
    gate, up = torch.randn(e, inter, hidden, generator=g) * 0.05, torch.randn(e, inter, hidden, generator=g) * 0.05
    down = torch.randn(e, hidden, inter, generator=g) * 0.05
    (qg, sg), (qu, su), (qd, sd) = (quantize_fp8_blocks(w) for w in (gate, up, down))
    q_gu, s_gu = torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)
    assert tiles_supported(q_gu, 128) and not tiles_supported(q_gu[:, :, :160], 128)
    t_gu, t_d = tile_experts(q_gu, 128), tile_experts(qd.clone(), 128, out=None)
    in_place = qd.clone()
    assert tile_experts(in_place, 128, out=in_place) is in_place and torch.equal(in_place.view(torch.uint8), t_d.view(torch.uint8))
    # tile (row block 1, K step 1) of expert 2's gate_up: rows 64..127, inputs 128..255, contiguous
    tile = t_gu[2].flatten()[(1 * hidden // 128 + 1) * TILE_ROWS * 128:][:TILE_ROWS * 128]
    assert torch.equal(tile.view(torch.uint8), q_gu[2, 64:128, 128:256].flatten().view(torch.uint8))
    x = torch.randn(t, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    for config in (dict(BLOCK_N=32, num_warps=4, num_stages=1), dict(BLOCK_N=64, num_warps=4, num_stages=1)):
        want = fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids, config=config)
        got = fused_moe_fp8(x, t_gu, s_gu, t_d, sd, w, ids, config=config, tiled=True)
        assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(fused_moe_fp8(x, t_gu, s_gu, t_d, sd, w, ids, batch_invariant=True, tiled=True),
                       fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids, batch_invariant=True))
    with pytest.raises(ValueError, match="multiple of"):
        tile_experts(q_gu[:, :100], 128)
    odd = q_gu[:, :, :192].contiguous()
    with pytest.raises(ValueError, match="tiled experts"):
        fused_moe_fp8(x[:, :192].contiguous(), odd, s_gu[:, :, :2].contiguous(), qd[:, :192].contiguous(),
                      sd[:, :3].contiguous(), w, ids, block=(128, 128), tiled=True)
    print("ok")
""")


def test_tiled_fp8_experts_equal_the_row_layout_bitwise():
    assert _interpret(_TILED_FP8).strip().endswith("ok")


# DEEPINFER_FP8_MOE_TILES=1: a layer's FP8 experts and the shared experts joined to them are tiled once at load (a
# second finalize leaves them), and the layer's output, joint launch or routed launch plus shared MLP, is the row
# layout's bit for bit.
_TILED_MOE_LAYER = textwrap.dedent("""
    import os
    import torch
    from deepinfer_rt.config import ModelConfig
    from deepinfer_rt.layers import moe as moe_module
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.moe import MoE
    from deepinfer_rt.models.loader import finalize

    def build(tiles):
        os.environ["DEEPINFER_FP8_MOE_TILES"] = "1" if tiles else "0"
        config = ModelConfig(architecture="DeepseekV2ForCausalLM", vocab_size=32, hidden_size=256,
                             intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16,
                             rms_norm_eps=1e-6, max_position=64, tie_word_embeddings=False, eos_token_ids=(0,),
                             bos_token_id=None, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
                             moe_intermediate_size=256)
        with build_context(KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=False)):
            moe = MoE(config)
        gen = torch.Generator().manual_seed(1)
        for p in moe.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        return finalize(moe)

    rows, tiled = build(False), build(True)
    assert tiled.experts.fp8_tiled and tiled.experts.method.tiled and not rows.experts.method.tiled
    assert not torch.equal(tiled.joint_experts[0].view(torch.uint8), rows.joint_experts[0].view(torch.uint8))
    before = tiled.joint_experts[0].clone()
    finalize(tiled.experts)
    assert torch.equal(tiled.joint_experts[0].view(torch.uint8), before.view(torch.uint8))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tiled(x), rows(x))
    moe_module.FUSED_SHARED_MAX_TOKENS = 2  # the routed launch alone, then the shared MLP's GEMMs
    assert torch.equal(tiled(x), rows(x))
    print("ok")
""")


def test_fp8_moe_layer_tiled_at_load_equals_the_row_layout():
    assert _interpret(_TILED_MOE_LAYER).strip().endswith("ok")
