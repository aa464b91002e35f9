"""Block-scaled FP8 on CUDA (skipped without a GPU).

- The Triton W8A8 block GEMM (deepinfer_kernels.fp8_gemm) against its torch form (reference.fp8_block_gemm:
  the same per-token, per-128-channel activation quantization, dequantize, fp32 matmul; no torch._scaled_mm) at
  DeepSeek-V2-Lite's projection shapes, 1 to 2048 rows, bf16 activations. Both quantize the activations from
  the same fp32 values; they differ by fp32 summation order, the bf16 output rounding and, rarely, an
  activation rounded to the neighbouring e4m3 value (the GPU's fp32 division): relative error <= 5e-3 in norm.
  Against the bf16 product of x and the dequantized weight the activations' e4m3 rounding leaves a few percent.
- The split fused kernel's partials added by each tile's last split (split_sum="last_program") against the second
  kernel, bit for bit, over many launches and graph replays.
- The FP8 GEMM's other paths (fp8_gemm(..., path="tiled" | "scaled_mm"): activations quantized once by
  deepinfer_kernels.fp8_quant, then the tiled Triton GEMM or torch's block-scaled scaled_mm) against the same torch
  form at V2-Lite and V3 shapes, M = 1 to 8192 (scaled_mm skipped, with the reason, where the torch build or the
  device lacks it); the quantizer against the fused kernel's own quantization, bit for bit.
- The FP8 fused MoE (deepinfer_kernels.fused_moe_fp8) against its torch form and the bf16 fused MoE at
  V2-Lite's expert shapes, 1 to 4096 tokens; timings beside the bf16 kernel printed.
- FP8 engines on a tiny random V3 (Engine(quantization="fp8") on a bf16 checkpoint, and the same checkpoint in
  the V3 release format): the two hold identical weights; the release engine's prompt logprobs are within
  PROMPT_LOGPROB_ERR of the CPU fp32 engine on the same (dequantized) weights (the bf16 engine's error beside it);
  greedy agreement with the bf16 engine on the bf16 weights is reported and held above
  GREEDY_FIRST_TOKEN_AGREEMENT.

    pytest test/gpu/test_gpu_fp8.py -s      (on a CUDA machine; -s prints the agreement and kernel timings)
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
V2_LITE_SHAPES = {  # (N, K) of the linears an FP8 V2-Lite would run through the GEMM
    "fused_qkv_a": (3072 + 576, 2048), "kv_b": (4096, 512), "o_proj": (2048, 2048),
    "dense_gate_up": (2 * 10944, 2048), "dense_down": (2048, 10944), "shared_gate_up": (2 * 2816, 2048),
}
GREEDY_FIRST_TOKEN_AGREEMENT = 0.1
"""Least fraction of prompts whose first greedy token is the same from the FP8 engine as from the bf16 engine
(reported with the agreement up to the first difference). The tiny random model's top logits over a 129K vocabulary
lie closer together than FP8's ~3% weight and activation errors move them (H200 runs gave 19% and 25% first-token
agreement), so this is a floor against a broken path, not a quality figure: the prompt-logprob check is that."""
DIMS = dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=192, q_lora_rank=192, kv_lora_rank=128)
"""The CPU test's dims (test/e2e/test_fp8_checkpoint.py), but a power-of-two latent for the decode kernel."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("m", [1, 5, 16])
def test_fp8_split_sum_by_last_program_equals_second_kernel(m):
    """split_sum='last_program' (each tile's last split adds the partials; a counter per tile) against the second
    kernel, bit for bit, over many launches eagerly and from a CUDA graph, at V2-Lite / V3 decode shapes: a missed
    partial (a memory-ordering fault) would show as a different sum."""
    from deepinfer_kernels.fp8_gemm import _tile_counters, fp8_block_gemm
    from deepinfer_kernels.reference import quantize_fp8_blocks

    g = torch.Generator(device=DEV).manual_seed(m)
    for n, k in ((2048, 10944), (3648, 2048), (2112, 7168)):
        q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02)
        x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
        bias = torch.randn(n, device=DEV, generator=g).bfloat16()
        want = fp8_block_gemm(x, q, s, 128, 128, bias)
        for _ in range(50):
            assert torch.equal(fp8_block_gemm(x, q, s, 128, 128, bias, split_sum="last_program"), want)
        graph = torch.cuda.CUDAGraph()
        fp8_block_gemm(x, q, s, 128, 128, bias, split_sum="last_program")  # compiled before the capture
        with torch.cuda.graph(graph):
            out = fp8_block_gemm(x, q, s, 128, 128, bias, split_sum="last_program")
        for _ in range(50):
            out.zero_()
            graph.replay()
            assert torch.equal(out, want)
        assert not _tile_counters(x.device).any()


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="dependent launches need SM90+")
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_block_gemm_dependent_launch(m):
    """The split GEMM and its split sum as dependent launches right after the kernel that writes the input: bitwise
    the ordinary launches' output (both split sums)."""
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm
    from deepinfer_kernels.reference import quantize_fp8_blocks

    g = torch.Generator(device=DEV).manual_seed(m)
    for n, k in ((2048, 10944), (3648, 2048), (2112, 7168)):
        q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02)
        x0 = torch.randn(m, k, device=DEV, generator=g).bfloat16()
        for split_sum in ("kernel", "last_program"):
            outs = []
            for pdl in (False, True):
                x = torch.empty_like(x0)
                torch.cuda.synchronize()
                x.copy_(x0)  # the kernel just before writes the input
                outs.append(fp8_block_gemm(x, q, s, 128, 128, split_sum=split_sum, pdl=pdl))
            assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("shape", list(V2_LITE_SHAPES), ids=list(V2_LITE_SHAPES))
@pytest.mark.parametrize("m", [1, 16, 64, 300, 2048])
def test_fp8_block_gemm_v2_lite_shapes(shape, m):
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, fp8_block_gemm as ref_gemm, quantize_fp8_blocks

    n, k = V2_LITE_SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(m * 7 + n)
    w = torch.randn(n, k, device=DEV, generator=g) * 0.02
    q, s = quantize_fp8_blocks(w)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    y = fp8_block_gemm(x, q, s, 128, 128)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, ref_gemm(x.float(), q, s)) <= 5e-3
    assert rel_err(y, x @ dequantize_fp8_blocks(q, s, dtype=torch.bfloat16).t()) <= 0.06
    rows = s.repeat_interleave(128, dim=0)[:n].contiguous()  # the per-row scales of off-boundary shards
    assert rel_err(fp8_block_gemm(x, q, rows, 1, 128), y) <= 1e-3
    assert rel_err(fp8_block_gemm(x, q, s, 128, 128, split_k=1), y) <= 1e-3  # split K (m <= 16) against none


def test_fp8_block_gemm_timing_vs_bf16():
    """Printed, not asserted: the FP8 GEMM beside cuBLAS bf16 on the dequantized weight."""
    from triton.testing import do_bench

    from deepinfer_kernels.fp8_gemm import fp8_block_gemm
    from deepinfer_kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks

    for name in ("fused_qkv_a", "dense_gate_up", "dense_down"):
        n, k = V2_LITE_SHAPES[name]
        q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV) * 0.02)
        wb = dequantize_fp8_blocks(q, s, dtype=torch.bfloat16)
        for m in (1, 64, 2048):
            x = torch.randn(m, k, device=DEV).bfloat16()
            t8 = do_bench(lambda: fp8_block_gemm(x, q, s, 128, 128))
            t16 = do_bench(lambda: x @ wb.t())
            print(f"fp8 gemm {name} M={m}: {t8 * 1e3:.1f} us, bf16 cuBLAS {t16 * 1e3:.1f} us")


V3_SHAPES = {  # (N, K) of full-width DeepSeek-V3 linears (hidden 7168, q_lora 1536, 128 heads, dense inter 18432)
    "fused_qkv_a": (1536 + 576, 7168), "q_b": (128 * 192, 1536), "o_proj": (7168, 128 * 128),
    "dense_gate_up": (2 * 18432, 7168), "dense_down": (7168, 18432),
}
GEMM_SHAPES = {**{f"v2lite_{k}": v for k, v in V2_LITE_SHAPES.items()}, **{f"v3_{k}": v for k, v in V3_SHAPES.items()}}


@pytest.mark.parametrize("path", ["tiled", "scaled_mm"])
@pytest.mark.parametrize("shape", list(GEMM_SHAPES), ids=list(GEMM_SHAPES))
@pytest.mark.parametrize("m", [1, 64, 2048, 8192])
def test_fp8_gemm_paths_against_reference(path, shape, m):
    """Paths B (tiled) and A (scaled_mm; the tiled path where N or K is not a multiple of 128) against the torch
    form, as the fused kernel above: the same activation quantization, fp32 sums in another order, the bf16 output
    rounding and a rare e4m3 neighbour (the GPU's fp32 division): relative error <= 5e-3 in norm. Against the fused
    kernel, which quantizes to the same values: <= 3e-3 (the bf16 rounding of two fp32 sums)."""
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm, fp8_gemm, scaled_mm_unsupported
    from deepinfer_kernels.reference import fp8_block_gemm as ref_gemm, quantize_fp8_blocks

    if path == "scaled_mm" and (reason := scaled_mm_unsupported(torch.device(DEV))) is not None:
        pytest.skip(reason)
    n, k = GEMM_SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(m * 7 + n)
    q, s = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) * 0.02)
    x = torch.randn(m, k, device=DEV, generator=g).bfloat16()
    bias = torch.randn(n, device=DEV, generator=g).bfloat16() if m == 64 else None
    y = fp8_gemm(x, q, s, 128, 128, bias, path=path)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    want = ref_gemm(x.float(), q, s) + (bias.float() if bias is not None else 0)
    assert rel_err(y, want) <= 5e-3
    assert rel_err(y, fp8_block_gemm(x, q, s, 128, 128, bias)) <= 3e-3
    if m == 64:  # 3-D input and per-row scales (off-boundary shards: the tiled path under either switch)
        rows = s.repeat_interleave(128, dim=0)[:n].contiguous()
        y3 = fp8_gemm(x.view(2, 32, k), q, rows, 1, 128, bias, path=path)
        # Under scaled_mm that is another path than y's: the bound of two fp32 sums rounded to bf16, as above
        # (measured 2.3e-3 - 2.7e-3 on the H200, over the 2e-3 this bound was first written with).
        assert y3.shape == (2, 32, n) and rel_err(y3.view(m, n), y) <= 3e-3 and rel_err(y3.view(m, n), want) <= 5e-3


@pytest.mark.parametrize("m", [1, 61, 2048])
def test_fp8_quantizer_equals_fused_kernel_quantization(m):
    """deepinfer_kernels.fp8_quant's values are the fused kernel's, bit for bit, compiled: through an identity
    weight with unit scales the fused kernel returns q(x) x s(x) per element (one nonzero product per output)."""
    from deepinfer_kernels.fp8_gemm import fp8_block_gemm
    from deepinfer_kernels.fp8_quant import quantize_fp8_token_groups
    from deepinfer_kernels.reference import expand_block_scales, quantize_fp8_token_groups as ref

    k = 2048
    x = torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, k // 128, device=DEV).repeat_interleave(128)
    q, sx = quantize_fp8_token_groups(x, 128, 4)
    eye = torch.eye(k, device=DEV).to(torch.float8_e4m3fn)
    fused = fp8_block_gemm(x, eye, torch.ones(k // 128, k // 128, device=DEV), 128, 128)
    assert torch.equal(fused, q[:m].float() * expand_block_scales(sx[:m], (m, k), (1, 128)))
    assert not q[m:].float().any()
    # The torch form on the same device: equal but for a rare neighbour (Triton's fp32 division).
    want_q, want_s = ref(x, 128)
    assert (q[:m].float() != want_q.float()).float().mean() <= 5e-3
    assert ((sx[:m] - want_s).abs() <= 3e-7 * want_s).all()  # within 2 ulp


V2_LITE_EXPERTS = dict(e=64, hidden=2048, inter=1408, k=6)


def _fp8_experts(e: int, hidden: int, inter: int, seed: int):
    from deepinfer_kernels.reference import quantize_fp8_blocks

    g = torch.Generator(device=DEV).manual_seed(seed)
    gate_up = torch.randn(e, 2 * inter, hidden, device=DEV, generator=g) * 0.02
    down = torch.randn(e, hidden, inter, device=DEV, generator=g) * 0.02
    (qg, sg), (qu, su) = quantize_fp8_blocks(gate_up[:, :inter]), quantize_fp8_blocks(gate_up[:, inter:])
    qd, sd = quantize_fp8_blocks(down)
    return torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1), qd, sd


@pytest.mark.parametrize("t", [1, 16, 64, 512, 4096])
def test_fused_moe_fp8_v2_lite_experts(t):
    """The FP8 fused MoE against its torch form (the same activation quantization; they differ by summation
    order and, through it, by an h rounded to the neighbouring bf16 value, whose e4m3 code can then flip: <= 2e-2
    in norm on the H200: 0.0140-0.0148 at 1-512 tokens) and against the bf16 fused MoE on the dequantized experts (the activations' e4m3 rounding: <= 6%)."""
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8
    from deepinfer_kernels.reference import dequantize_fp8_blocks, fused_moe_fp8 as ref

    c = V2_LITE_EXPERTS
    q_gu, s_gu, qd, sd = _fp8_experts(c["e"], c["hidden"], c["inter"], seed=t)
    g = torch.Generator(device=DEV).manual_seed(t + 1)
    x = torch.randn(t, c["hidden"], device=DEV, generator=g).bfloat16()
    ids = torch.rand(t, c["e"], device=DEV, generator=g).topk(c["k"], dim=-1).indices
    w = torch.rand(t, c["k"], device=DEV, generator=g)
    y = fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    if t <= 512:  # the torch form holds a (T*k, I, H) gather
        assert rel_err(y, ref(x, q_gu, s_gu, qd, sd, w, ids)) <= 2e-2
    bf16 = fused_moe(x, dequantize_fp8_blocks(q_gu, s_gu, dtype=torch.bfloat16),
                     dequantize_fp8_blocks(qd, sd, dtype=torch.bfloat16), w, ids)
    assert rel_err(y, bf16) <= 0.06


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_fp8_moe_joins_shared_experts(num_tokens, monkeypatch):
    """An FP8 MoE on the GPU (V2-Lite's 64 experts, top-6, two shared; widths of one 128-block) joins its shared
    experts to the routed launch: equal within 4e-2 in norm to the same MoE with the shared MLP's FP8 GEMMs apart
    (the two round the shared h to bf16 from different fp32 sums, which flips an e4m3 code now and then: 2.2% at one
    token on an H100; a cut across a scale block or a swapped scale is off by its whole size), and within 8% of the
    fp32 CPU MoE on the unquantized weights."""
    from helpers import moe_config

    from deepinfer_rt.layers import moe as moe_module
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.moe import MoE
    from deepinfer_rt.models.loader import finalize

    config = moe_config(hidden=256, experts=64, top_k=6, inter=128)
    gen = torch.Generator().manual_seed(num_tokens)
    ref = MoE(config)
    for p in ref.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    with build_context(KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=False)):
        moe = MoE(config)
    moe.load_state_dict(ref.state_dict())
    moe = finalize(moe.to(DEV, torch.bfloat16))
    assert moe.joint_experts is not None and moe.joint_experts[0].shape[0] == 66
    x = torch.randn(num_tokens, 256, generator=gen).to(torch.bfloat16).float()
    joint = moe(x.to(DEV, torch.bfloat16))
    monkeypatch.setattr(moe_module, "FUSED_SHARED_MAX_TOKENS", 0)
    apart = moe(x.to(DEV, torch.bfloat16))
    assert rel_err(joint, apart) <= 4e-2
    assert rel_err(joint.cpu(), ref(x)) <= 0.08


@pytest.mark.parametrize("t", [1, 64, 512])
def test_fused_moe_fp8_tiled_layout(t, monkeypatch):
    """V2-Lite's experts reordered by tile_experts (contiguous 64 x 128 tiles): the same sums in the same order, so
    bitwise the row layout's at a fixed tile and within 1e-3 in norm through the autotuner (it may pick another
    tile for each layout); an MoE layer built under DEEPINFER_FP8_MOE_TILES=1 holds tiled experts (the shared ones
    in its joint launch too) and matches one built without within 1e-3 in norm."""
    from helpers import moe_config

    from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8, tile_experts
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.moe import MoE
    from deepinfer_rt.models.loader import finalize

    c = V2_LITE_EXPERTS
    q_gu, s_gu, qd, sd = _fp8_experts(c["e"], c["hidden"], c["inter"], seed=t + 7)
    t_gu, t_d = tile_experts(q_gu, 128), tile_experts(qd, 128)
    g = torch.Generator(device=DEV).manual_seed(t)
    x = torch.randn(t, c["hidden"], device=DEV, generator=g).bfloat16()
    ids = torch.rand(t, c["e"], device=DEV, generator=g).topk(c["k"], dim=-1).indices
    w = torch.rand(t, c["k"], device=DEV, generator=g)
    fixed = dict(BLOCK_N=64, num_warps=4, num_stages=3)
    assert torch.equal(fused_moe_fp8(x, t_gu, s_gu, t_d, sd, w, ids, config=fixed, tiled=True),
                       fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids, config=fixed))
    assert rel_err(fused_moe_fp8(x, t_gu, s_gu, t_d, sd, w, ids, tiled=True),
                   fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids)) <= 1e-3
    config = moe_config(hidden=256, experts=64, top_k=6, inter=256)
    gen = torch.Generator().manual_seed(t)
    ref = MoE(config)
    for p in ref.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    layers = {}
    for tiles in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_FP8_MOE_TILES", tiles)
        with build_context(KernelConfig(device_type="cuda", quantization="fp8", is_checkpoint_quantized=False)):
            layers[tiles] = MoE(config)
        layers[tiles].load_state_dict(ref.state_dict())
        layers[tiles] = finalize(layers[tiles].to(DEV, torch.bfloat16))
    assert layers["1"].experts.method.tiled and not layers["0"].experts.method.tiled
    x = torch.randn(t, 256, generator=gen).to(DEV, torch.bfloat16)
    assert rel_err(layers["1"](x), layers["0"](x)) <= 1e-3


def test_batch_invariant_fp8_moe_and_gemm_bitwise():
    """Batch-invariant mode's FP8 paths compiled: the fused MoE (INVARIANT_TILES) and the tiled GEMM
    (INVARIANT_TILE) give each token the same bits alone and in batches of 64 / 300 tokens, V2-Lite shapes."""
    from deepinfer_kernels.fp8_gemm import fp8_invariant_gemm
    from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8
    from deepinfer_kernels.reference import fp8_block_gemm as ref_gemm, quantize_fp8_blocks

    c = V2_LITE_EXPERTS
    q_gu, s_gu, qd, sd = _fp8_experts(c["e"], c["hidden"], c["inter"], seed=5)
    g = torch.Generator(device=DEV).manual_seed(6)
    x = torch.randn(300, c["hidden"], device=DEV, generator=g).bfloat16()
    ids = torch.rand(300, c["e"], device=DEV, generator=g).topk(c["k"], dim=-1).indices
    w = torch.rand(300, c["k"], device=DEV, generator=g)
    full = fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids, batch_invariant=True)
    for rows in (slice(0, 1), slice(7, 71), slice(0, 300, 5)):
        xs, ws, ids_s = (t[rows].contiguous() for t in (x, w, ids))
        assert torch.equal(fused_moe_fp8(xs, q_gu, s_gu, qd, sd, ws, ids_s, batch_invariant=True), full[rows]), rows
    qw, sw = quantize_fp8_blocks(torch.randn(3072 + 576, c["hidden"], device=DEV, generator=g) * 0.02)
    y = fp8_invariant_gemm(x, qw, sw, 128, 128)
    assert rel_err(y, ref_gemm(x.float(), qw, sw)) <= 5e-3
    for rows in (slice(0, 1), slice(7, 71), slice(0, 300, 5)):
        assert torch.equal(fp8_invariant_gemm(x[rows].contiguous(), qw, sw, 128, 128), y[rows]), rows


def test_fused_moe_fp8_timing_vs_bf16():
    """Printed, not asserted: the FP8 fused MoE beside the bf16 one on the dequantized experts (V2-Lite)."""
    from triton.testing import do_bench

    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_kernels.fused_moe_fp8 import fused_moe_fp8
    from deepinfer_kernels.reference import dequantize_fp8_blocks

    c = V2_LITE_EXPERTS
    q_gu, s_gu, qd, sd = _fp8_experts(c["e"], c["hidden"], c["inter"], seed=0)
    gu16, d16 = (dequantize_fp8_blocks(q, s, dtype=torch.bfloat16) for q, s in ((q_gu, s_gu), (qd, sd)))
    for t in (1, 64, 256, 4096):
        x = torch.randn(t, c["hidden"], device=DEV).bfloat16()
        ids = torch.rand(t, c["e"], device=DEV).topk(c["k"], dim=-1).indices
        w = torch.rand(t, c["k"], device=DEV)
        t8 = do_bench(lambda: fused_moe_fp8(x, q_gu, s_gu, qd, sd, w, ids))
        t16 = do_bench(lambda: fused_moe(x, gu16, d16, w, ids))
        print(f"fused moe T={t}: fp8 {t8 * 1e3:.1f} us, bf16 {t16 * 1e3:.1f} us")


@pytest.fixture(scope="module")
def v3_paths(tmp_path_factory):
    """(bf16 folder, its V3 release-format FP8 folder, an fp32 folder of the FP8 folder's dequantized weights)."""
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint
    from quantize_checkpoint import quantize_checkpoint

    from deepinfer_kernels.reference import dequantize_fp8_blocks

    root = tmp_path_factory.mktemp("fp8-gpu")
    src = make_tiny_checkpoint("deepseek_v3", root / "bf16", seed=0, tokenizer_dir=_tokenizer_dir("deepseek_v3"),
                               **DIMS)
    # In bf16, so that quantizing at load (after the engine's cast to bf16) and the quantizer start from the same
    # values.
    tensors = load_file(src / "model.safetensors")
    save_file({n: t.to(torch.bfloat16) for n, t in tensors.items()}, src / "model.safetensors",
              metadata={"format": "pt"})
    fp8 = quantize_checkpoint(src, root / "fp8", "v3-fp8")
    q = load_file(fp8 / "model.safetensors")
    deq = root / "dequant"
    shutil.copytree(src, deq)
    save_file({n: dequantize_fp8_blocks(t, q[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t.float()
               for n, t in q.items() if not n.endswith("_scale_inv")}, deq / "model.safetensors",
              metadata={"format": "pt"})
    return src, fp8, deq


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


PROMPT_LOGPROB_ERR = 0.75
"""Most mean |prompt logprob - the CPU fp32 engine's| (nats) of the FP8 engine on the release folder: its
weights are exactly the fp32 reference's, so the error is bf16 activations plus their e4m3 quantization in every
GEMM. This tiny random model is very sensitive to it: on an H200 the bf16 engine was 0.12 nats off and the FP8
engine 0.51; on CPU, quantizing the activations of the same linears (per token, per 128 channels) in an
otherwise fp32 model moved them by 0.48 nats, so the GPU figure is the activation scheme's, not the kernel's. A
wrong scale block, shard or row layout gives errors of nats."""


def _prompt_logprobs(engine, prompts) -> list[float]:
    from deepinfer_rt import SamplingParams

    sp = SamplingParams(max_new_tokens=1, temperature=0, prompt_logprobs=True)
    return [x for o in engine.generate(input_ids=prompts, sampling_params=sp) for x in o.prompt_logprobs[1:]]


def test_fp8_engine_vs_bf16_engine(v3_paths):
    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear

    src, fp8, deq = v3_paths
    sp = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(device=DEV, dtype="bfloat16", kv_cache_tokens=8192, max_num_seqs=16)
    rng = random.Random(0)
    with Engine(str(fp8), device="cpu", dtype="float32", kv_cache_tokens=8192) as cpu:
        prompts = [[rng.randrange(cpu.model_config.vocab_size) for _ in range(rng.randrange(3, 60))]
                   for _ in range(16)]
        ref_lp = _prompt_logprobs(cpu, prompts)
    with Engine(str(src), **kw) as bf16:
        want = [o.token_ids for o in bf16.generate(input_ids=prompts, sampling_params=sp)]
    with Engine(str(deq), **kw) as bf16_deq:
        bf16_lp = _prompt_logprobs(bf16_deq, prompts)
    with Engine(str(src), quantization="fp8", **kw) as online:
        proj = online.model.model.layers[0].self_attn.fused_qkv_a_proj
        assert isinstance(proj.method, Fp8BlockLinear) and proj.weight.dtype == torch.float8_e4m3fn
        assert proj.scale_group_n == 1  # kv_a starts at row 192, inside a block
        assert online.model.model.layers[0].mlp.down_proj.scale_group_n == 128
        online_weights = {n: p.detach().clone() for n, p in online.model.named_parameters()}
        got = [o.token_ids for o in online.generate(input_ids=prompts, sampling_params=sp)]
    with Engine(str(fp8), **kw) as release:
        for n, p in release.model.named_parameters():  # quantized at load = the quantizer's release folder
            assert torch.equal(p, online_weights[n]), n
        fp8_lp = _prompt_logprobs(release, prompts)
    err_bf16 = sum(abs(a - b) for a, b in zip(bf16_lp, ref_lp)) / len(ref_lp)
    err_fp8 = sum(abs(a - b) for a, b in zip(fp8_lp, ref_lp)) / len(ref_lp)
    agree = sum(_common_prefix(a, b) for a, b in zip(got, want)) / sum(map(len, want))
    first = sum(a[0] == b[0] for a, b in zip(got, want)) / len(want)
    print(f"prompt logprobs vs CPU fp32 (mean abs, nats): bf16 engine {err_bf16:.4f}, FP8 engine {err_fp8:.4f}; "
          f"FP8 vs bf16 greedy agreement {agree:.2%} of tokens (to the first difference), first token {first:.0%}")
    assert err_fp8 <= PROMPT_LOGPROB_ERR
    assert first >= GREEDY_FIRST_TOKEN_AGREEMENT


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs SM90+")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_engine_with_dependent_launches_is_bitwise_the_same(v3_paths, fmt, graphs, monkeypatch):
    """DEEPINFER_GPU_PDL: the kernels that take it (norms, MLA's rope-and-store, routing, the fused MoE's and, in FP8,
    the FP8 GEMMs' and quantizations) start before the kernel before them ends and wait for it first thing; the
    arithmetic is unchanged, so the greedy tokens and logprobs of the tiny V3 (bf16 and its release FP8 format) are
    bitwise those of ordinary launches, with and without graphs."""
    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.layers.fp8 import Fp8BlockLinear
    from deepinfer_rt.layers.methods import TritonRMSNorm
    from deepinfer_rt.layers.moe import Fp8FusedExperts, FusedExperts

    src, fp8, _ = v3_paths
    rng = random.Random(5)
    prompts = [[rng.randrange(1000) for _ in range(n)] for n in (3, 40, 17, 9)]
    sp = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, logprobs=True)
    monkeypatch.setenv("DEEPINFER_CUDA_GRAPH_MAX_BS", "8" if graphs else "0")
    kinds = (TritonRMSNorm, FusedExperts, Fp8FusedExperts, Fp8BlockLinear)
    outs = {}
    for pdl in (True, False):
        monkeypatch.setenv("DEEPINFER_GPU_PDL", "1" if pdl else "0")
        with Engine(str(fp8 if fmt == "fp8" else src), device=DEV, dtype="bfloat16", kv_cache_tokens=4096,
                    max_num_seqs=4) as engine:
            methods = [m.method for m in engine.model.modules() if isinstance(getattr(m, "method", None), kinds)]
            assert methods and all(m.pdl == pdl for m in methods)
            assert (fmt == "fp8") == any(isinstance(m, Fp8BlockLinear) for m in methods)
            outs[pdl] = engine.generate(input_ids=prompts, sampling_params=sp)
    for a, b in zip(outs[True], outs[False]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
