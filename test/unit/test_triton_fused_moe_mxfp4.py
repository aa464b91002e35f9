"""The fused MXFP4 MoE (deepinfer_kernels.fused_moe_mxfp4) through Triton's interpreter on CPU against
dequantize-then-matmul (layers/quant_formats.py dequantize_mxfp4, then fp32 matmuls and V4's clamped SwiGLU), with
K tails inside a tile (hidden 96 = 3 groups of 32 under BLOCK_K 64), one-block-per-pair and sorted routing, fp32
and fp16 activations; and DeepSeek-V4's ClampedExperts built for CUDA (Mxfp4FusedExperts: 4-bit weights kept)
against the same module built for CPU (dequantized at load). The GPU suite runs the kernel compiled at V4-Flash
shapes (test/gpu/test_gpu_mxfp4_moe.py).

Tolerance: every dequantized weight is exact in the operand dtype, so in fp32 the two sides differ by summation
order only (<= 1e-5 of the output's max). In fp16, h is rounded to fp16 between the GEMMs and the operands are
fp16 (the fp32 reference keeps h unrounded): <= 2e-3 in norm.
"""
from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("triton")

from test_triton_interpreted import _interpret  # noqa: E402

_KERNEL = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from deepinfer_kernels.fused_moe_mxfp4 import fused_moe_mxfp4
    from deepinfer_rt.layers.quant_formats import dequantize_mxfp4, quantize_mxfp4
    g = torch.Generator().manual_seed(0)
    e, hidden, inter, k, limit = 4, 96, 64, 2, 0.3
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g) * 0.05
    gate_up[:, :, :32] *= 10  # groups of very different scales
    down = torch.randn(e, hidden, inter, generator=g) * 0.05
    (q_gu, s_gu), (qd, sd) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    d_gu, d_down = dequantize_mxfp4(q_gu, s_gu), dequantize_mxfp4(qd, sd)

    def reference(x, w, ids, limit):
        out = torch.zeros(x.shape[0], hidden)
        for j in range(ids.shape[1]):
            gu = torch.einsum("th,tnh->tn", x.float(), d_gu[ids[:, j]])
            gate, up = gu.chunk(2, dim=-1)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = F.silu(gate) * up
            out += torch.einsum("ti,thi->th", h, d_down[ids[:, j]]) * w[:, j:j + 1]
        return out

    clamped = 0
    for dtype, t, lim in ((torch.float32, 5, limit), (torch.float32, 40, limit), (torch.float16, 40, limit),
                          (torch.float32, 7, None)):
        x = torch.randn(t, hidden, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=g)
        y = fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, w, ids, lim, config=dict(BLOCK_N=32, BLOCK_K=64, num_warps=4,
                                                                              num_stages=1))
        want = reference(x, w, ids, lim)
        assert y.shape == (t, hidden) and y.dtype == dtype
        diff = y.float() - want
        if dtype == torch.float32:
            assert diff.abs().max() <= 1e-5 * want.abs().max(), (t, diff.abs().max().item())
        else:
            assert diff.norm() <= 2e-3 * want.norm(), (t, (diff.norm() / want.norm()).item())
        if lim is not None:
            clamped += int((torch.einsum("th,nh->tn", x.float(), d_gu[0]).abs() > lim).sum())
    assert clamped > 0  # the limit was reached, so the clamp was exercised
    # 128-element K tiles (the GPU default) over the same weights: a tile wider than hidden (masked) and than inter
    x = torch.randn(9, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(9)])
    w = torch.rand(9, k, generator=g)
    y = fused_moe_mxfp4(x, q_gu, s_gu, qd, sd, w, ids, limit, config=dict(BLOCK_N=64, BLOCK_K=128, num_warps=4,
                                                                           num_stages=1))
    want = reference(x, w, ids, limit)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    for bad, message in ((dict(gate_up_scale=s_gu.repeat_interleave(2, dim=-1)), "gate_up_scale shape"),
                         (dict(down=qd.view(torch.uint8)), "int8-packed"),
                         (dict(down_scale=sd.view(torch.uint8).float()), "e8m0")):
        args = dict(gate_up=q_gu, gate_up_scale=s_gu, down=qd, down_scale=sd) | bad
        try:
            fused_moe_mxfp4(x, args["gate_up"], args["gate_up_scale"], args["down"], args["down_scale"], w, ids)
        except ValueError as err:
            assert message in str(err), err
        else:
            raise AssertionError(f"{message}: accepted")
    print("ok")
""")

# DeepSeek-V4's routed experts built for CUDA keep an MXFP4 checkpoint's experts 4-bit and run the kernel (here
# interpreted); built for CPU they dequantize at load. Same fused checkpoint tensors, same routing.
_CLAMPED_EXPERTS = textwrap.dedent("""
    import types
    import torch
    from deepinfer_rt.config import QuantConfig
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.mxfp4 import Mxfp4DequantExperts, Mxfp4FusedExperts
    from deepinfer_rt.layers.quant_formats import quantize_mxfp4
    from deepinfer_rt.models.deepseek_v4.moe import ClampedExperts
    g = torch.Generator().manual_seed(1)
    cfg = types.SimpleNamespace(n_routed_experts=3, hidden_size=64, moe_intermediate_size=96, swiglu_limit=0.4)
    quant = QuantConfig("fp8", (32, 32), "ue8m0", "fp4")
    (q_gu, s_gu), (qd, sd) = (quantize_mxfp4(torch.randn(3, *shape, generator=g) * 0.1)
                              for shape in ((192, 64), (64, 96)))
    x = torch.randn(11, 64, generator=g)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(11)])
    w = torch.rand(11, 2, generator=g)
    out = {}
    for device in ("cuda", "cpu"):
        with build_context(KernelConfig(device_type=device).for_checkpoint(quant)):
            experts = ClampedExperts(cfg)
        want = Mxfp4FusedExperts if device == "cuda" else Mxfp4DequantExperts
        assert type(experts.weights_method) is want, (device, experts.weights_method)
        params = dict(experts.named_parameters())
        for name, t in (("gate_up_proj", q_gu), ("gate_up_proj_scale_inv", s_gu), ("down_proj", qd),
                        ("down_proj_scale_inv", sd)):
            params[name].weight_loader(params[name], t)
        experts.process_weights_after_loading()
        experts = experts.to(torch.float32)
        if device == "cuda":
            assert experts.gate_up_proj.dtype == torch.int8 and experts.down_proj.shape == (3, 64, 48)
            assert experts.down_proj_scale_inv.dtype == torch.uint8
        out[device] = experts(x, w, ids)
    err = (out["cuda"] - out["cpu"]).abs().max()
    assert err <= 1e-5 * out["cpu"].abs().max(), err.item()
    print("ok")
""")


def test_fused_moe_mxfp4_equals_dequantize_then_matmul():
    assert _interpret(_KERNEL).strip().endswith("ok")


def test_clamped_experts_run_the_kernel_on_cuda_builds():
    assert _interpret(_CLAMPED_EXPERTS).strip().endswith("ok")
