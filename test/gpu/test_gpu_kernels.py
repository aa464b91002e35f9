"""Each Triton kernel against its torch reference on random data (CUDA only)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
BF16 = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("shape", [(16, 1, 576, 512), (4, 1, 40, 32), (9, 3, 64, 64), (32, 8, 128, 128)],
                         ids=["mla-v2", "mla-tiny", "gqa-smollm2", "gqa-llama8b"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [1, 8])
def test_paged_decode_attention(shape, page_size, num_splits):
    from deepinfer_kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

    hq, hkv, dk, dv = shape
    torch.manual_seed(hash((shape, page_size, num_splits)) % 2**31)
    lens = torch.tensor([1, 0, 300, 77, 1025], dtype=torch.int32, device=DEV)
    width = 1100 // page_size + 1
    num_pages = 6 * width
    k = torch.randn(num_pages * page_size, hkv, dk, dtype=BF16, device=DEV)
    v = k[..., :dv] if hkv == 1 else torch.randn(num_pages * page_size, hkv, dv, dtype=BF16, device=DEV)
    table = torch.randperm(num_pages, device=DEV)[: 6 * width].view(6, width).to(torch.int32)
    rows = torch.tensor([5, 1, 0, 3, 2], dtype=torch.int32, device=DEV)
    q = torch.randn(5, hq, dk, dtype=BF16, device=DEV)
    out = torch.full((5, hq, dv), float("nan"), dtype=BF16, device=DEV)  # poisoned: every element written
    paged_decode_attention(q, k, v, table, rows, lens, page_size, dk**-0.5, num_splits, out=out)
    ref = paged_decode_attention_ref(q, k, v, table, rows, lens, page_size, dk**-0.5)
    assert rel_err(out, ref) < 1e-2
    assert (out[1] == 0).all()  # an empty sequence yields zeros



@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="dependent launches need SM90+")
@pytest.mark.parametrize("shape", [(16, 1, 576, 512), (9, 3, 64, 64)], ids=["mla-v2", "gqa-smollm2"])
def test_paged_decode_attention_dependent_launch(shape):
    """As a dependent launch right after a dependent launch that writes its query (the new K rows written just
    before): bitwise the ordinary launch's output, with one split and with several (the merge kernel too)."""
    from deepinfer_kernels.decode_attention import paged_decode_attention
    from deepinfer_kernels.v4_elementwise import rope

    hq, hkv, dk, dv = shape
    torch.manual_seed(7)
    ones, zeros = torch.ones(4, 16, device=DEV), torch.zeros(4, 16, device=DEV)
    page_size, width = 16, 80
    lens = torch.tensor([1, 300, 1025, 1264], dtype=torch.int32, device=DEV)
    k = torch.randn(4 * width * page_size, hkv, dk, dtype=BF16, device=DEV)
    v = k[..., :dv] if hkv == 1 else torch.randn(k.shape[0], hkv, dv, dtype=BF16, device=DEV)
    table = torch.randperm(4 * width, device=DEV).view(4, width).to(torch.int32)
    rows = torch.arange(4, dtype=torch.int32, device=DEV)
    last = (table[rows.long(), ((lens - 1) // page_size).long()] * page_size + (lens - 1) % page_size).long()
    q0 = torch.randn(4, hq, dk, dtype=BF16, device=DEV)
    new_k = torch.randn(4, hkv, dk, dtype=BF16, device=DEV)
    outs = []
    for pdl in (False, True):
        for splits in (1, 8, 64):
            k[last] = 0
            torch.cuda.synchronize()
            k[last] = new_k
            q = rope(q0, ones, zeros, pdl=pdl)  # q0 itself, written by a dependent launch just before
            out = paged_decode_attention(q, k, v, table, rows, lens, page_size, dk**-0.5, splits, pdl=pdl)
            assert torch.equal(q, q0)
            outs.append(out.clone())
    for a, b in zip(outs[:3], outs[3:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("num_tokens", [1, 3, 40, 700])
def test_fused_moe(num_tokens):
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_rt.layers.moe import RoutedExperts, select_experts

    torch.manual_seed(num_tokens)
    e, hidden, inter, k = 64, 256, 176, 6
    experts = RoutedExperts(e, hidden, inter).to(DEV, BF16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    x = torch.randn(num_tokens, hidden, dtype=BF16, device=DEV)
    weights, ids = select_experts(torch.randn(num_tokens, e, device=DEV), k)
    out = fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    # RoutedExperts' torch path (what runs on CPU), in fp32 on copies of the same weights.
    ref = copy.deepcopy(experts).float().cpu()(x.float().cpu(), weights.cpu(), ids.cpu())
    assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("num_tokens", [1, 16, 256, 600])
def test_moe_with_shared_experts_joined(num_tokens):
    """MoE on GPU with the shared experts joined to the routed ones (up to FUSED_SHARED_MAX_TOKENS rows) and
    without (more rows) against its CPU fp32 form, the shared MLP run apart."""
    from helpers import moe_config

    from deepinfer_rt.layers.moe import FUSED_SHARED_MAX_TOKENS, MoE

    config = moe_config(hidden=256, experts=64, top_k=6, inter=176)
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context

    gen = torch.Generator().manual_seed(num_tokens)
    ref = MoE(config)
    for p in ref.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    with build_context(KernelConfig.from_env("cuda")):  # the Triton methods (fused experts, routing kernel)
        moe = MoE(config)
    moe.load_state_dict(ref.state_dict())
    moe = moe.to(DEV, BF16)
    moe.process_weights_after_loading()
    assert moe.joint_experts is not None and moe.joint_experts[0].shape[0] == 66
    assert moe.experts.gate_up_proj.data_ptr() == moe.joint_experts[0].data_ptr()  # a view, not a copy
    x = torch.randn(num_tokens, 256, generator=gen).to(BF16).float()  # the GPU's input, so both route alike
    out = moe(x.to(DEV, BF16))
    assert (num_tokens <= FUSED_SHARED_MAX_TOKENS) == (num_tokens < 600)
    assert rel_err(out.cpu(), ref(x)) < 1e-2


@pytest.mark.parametrize("num_tokens,num_experts,k,block_m", [(50, 8, 2, 16), (64, 64, 6, 32), (256, 64, 6, 64),
                                                               (500, 256, 8, 64), (3, 160, 6, 16)])
def test_moe_align_sorts_pairs_by_expert(num_tokens, num_experts, k, block_m):
    from deepinfer_kernels.fused_moe import moe_align, moe_align_torch

    torch.manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, device=DEV).pow(4).topk(k, dim=-1).indices  # skewed, distinct per row
    got = moe_align(ids, num_experts, block_m)
    flat = ids.flatten()
    used = int(got[2])
    pairs = got[0][:used].view(-1, block_m)
    for b in range(pairs.shape[0]):
        real = pairs[b][pairs[b] < flat.numel()]
        assert (flat[real.long()] == got[1][b]).all()
    assert sorted(got[0][:used][got[0][:used] < flat.numel()].tolist()) == list(range(flat.numel()))
    ref = moe_align_torch(ids, num_experts, block_m)  # the same rows, in the same (stable) order
    assert int(ref[2]) == used
    assert torch.equal(got[0][:used].long(), ref[0][:used].long())
    assert torch.equal(got[1][: used // block_m].long(), ref[1][: used // block_m].long())


ROUTER_CASES = {  # (experts, k, scoring, method, groups, kept groups, renormalise, scaling): V2-Lite, V2, V3
    "v2-lite": (64, 6, "softmax", "greedy", 1, 1, False, 1.0),
    "v2": (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),
    "v3": (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5)}


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
@pytest.mark.parametrize("num_tokens", [1, 37, 300])
def test_moe_router_kernel_equals_torch_form(case, num_tokens):
    from deepinfer_rt.layers.methods import Activation
    from deepinfer_rt.layers.moe import TritonRouting, select_experts

    e, k, scoring, method, groups, kept, norm, scale = ROUTER_CASES[case]
    torch.manual_seed(num_tokens)
    logits = torch.randn(num_tokens, e, device=DEV) * 3
    bias = torch.randn(e, device=DEV) * 0.1 if method == "noaux_tc" else None
    kw = dict(scoring_func=scoring, topk_method=method, n_group=groups, topk_group=kept, correction_bias=bias,
              norm_topk_prob=norm, routed_scaling_factor=scale)
    weights, ids = TritonRouting(Activation())(logits, k, **kw)  # the Triton kernel
    ref_w, ref_ids = select_experts(logits.cpu(), k, **{**kw, "correction_bias": None if bias is None else bias.cpu()})
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual):
    from deepinfer_kernels import elementwise, reference

    x = torch.randn(37, 2048, dtype=BF16, device=DEV)
    w = torch.randn(2048, dtype=BF16, device=DEV)
    if with_residual:
        r = torch.randn_like(x)
        out, s = elementwise.rms_norm(x, w, 1e-6, r)
        assert torch.equal(s, x + r)
        assert rel_err(out, reference.rms_norm(x + r, w, 1e-6)) < 1e-2
    else:
        assert rel_err(elementwise.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)) < 1e-2


@pytest.mark.parametrize("interleave", [False, True])
def test_rope(interleave):
    from deepinfer_kernels import elementwise, reference

    d = 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = elementwise.rope_cache(inv, 1.0, 4096, torch.device(DEV))
    pos = torch.randint(0, 4096, (33,), device=DEV)
    x = torch.randn(33, 16, 192, dtype=BF16, device=DEV)[..., 128:]  # a strided view, as MLA's q_pe
    freqs = pos[:, None].float() * inv.to(DEV)[None]
    emb = torch.cat((freqs, freqs), -1)
    ref = reference.apply_rope(x.clone(), emb.cos().to(BF16), emb.sin().to(BF16), interleave)
    assert rel_err(elementwise.apply_rope_(x, pos, cos, sin, interleave), ref) < 1e-2


def test_silu_and_mul_and_store_kv():
    from deepinfer_kernels import elementwise, reference

    x = torch.randn(9, 2 * 1408, dtype=BF16, device=DEV)
    assert rel_err(elementwise.silu_and_mul(x), reference.silu_and_mul(x)) < 1e-2
    buf = torch.randn(64, 1, 576, dtype=BF16, device=DEV)
    src = torch.randn(4, 1, 576, dtype=BF16, device=DEV)
    slots = torch.tensor([3, -1, 60, 7], device=DEV)
    expect = buf.clone()
    expect[[3, 60, 7]] = src[[0, 2, 3]]
    elementwise.store_kv(buf, slots, src)
    assert torch.equal(buf, expect)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n,k", [(3072, 2048), (576, 2048), (2048, 2816), (1000, 96), (102400, 2048)])
def test_skinny_gemm(rows, n, k):
    """The decode-size dense projection kernel against an fp32 F.linear, with a bias and strided rows; the
    engine routes F.linear of <= 16 CUDA rows times a large weight (the LM head) to it."""
    from deepinfer_kernels.skinny_gemm import MIN_WEIGHT_ELEMENTS, skinny_gemm, supports
    from deepinfer_rt.layers.methods import SkinnyLinear

    torch.manual_seed(rows * 7 + n + k)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
    bias = torch.randn(n, device=DEV, dtype=BF16)
    x = torch.randn(rows, k + 32, device=DEV, dtype=BF16)[:, 32:]
    assert supports(x, w) == (n * k >= MIN_WEIGHT_ELEMENTS)
    ref = F.linear(x.float(), w.float(), bias.float())
    assert rel_err(skinny_gemm(x, w, bias), ref) < 1e-2
    assert rel_err(SkinnyLinear().linear(x, w), F.linear(x.float(), w.float())) < 1e-2
    assert not supports(torch.randn(17, k, device=DEV, dtype=BF16), w)


def test_router_gemm_matches_linear_on_gpu():
    from deepinfer_kernels.router_gemm import router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(64, 2048, generator=g, device="cuda") / 2048**0.5
    x = torch.randn(8192, 2048, generator=g, device="cuda").bfloat16()
    alone = router_logits(x[:3], w)
    for t in (1, 64, 256, 8192):
        y = router_logits(x[:t], w)
        torch.testing.assert_close(y, F.linear(x[:t].float(), w), rtol=1e-4, atol=1e-4)
        assert torch.equal(y[:3], alone[:t])
    assert torch.equal(router_logits(x[-1:], w), y[-1:])


@pytest.mark.parametrize("e, h", [(64, 2048), (70, 200), (256, 7168)])
def test_router_logits_bf16_as_close_as_sgemm(e, h):
    """Tensor-core logits over the weight's bf16 pieces: as close to float64 as an fp32 sgemm of bf16 x."""
    from deepinfer_kernels.router_gemm import router_logits_bf16, split_weight

    g = torch.Generator(device="cuda").manual_seed(e)
    w = torch.randn(e, h, generator=g, device="cuda") / h**0.5
    pieces = split_weight(w)
    for t in (1, 257, 1000, 4096):
        x = torch.randn(t, h, generator=g, device="cuda").bfloat16()
        ref = x.double() @ w.double().T
        got = router_logits_bf16(x, pieces)
        sgemm = (x.float().cpu() @ w.cpu().T).double()
        assert got.dtype == torch.float32 and got.shape == (t, e)
        err = (got.double() - ref).abs().max().item()
        assert err <= 4 * (sgemm - ref.cpu()).abs().max().item() + 1e-9, (t, err)


def test_router_takes_the_pieces_at_prefill_sizes():
    from deepinfer_kernels.router_gemm import router_logits_bf16
    from types import SimpleNamespace

    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.layers.moe import ROUTER_PIECES_MIN_ROWS, Router

    config = SimpleNamespace(hidden_size=512, n_routed_experts=64, topk_method="greedy")
    with build_context(KernelConfig.from_env("cuda")):  # TritonRouterGemm
        router = Router(config).cuda()
    router.weight.data.normal_(0, 512**-0.5)
    assert router.weight_pieces is None
    router.process_weights_after_loading()
    x = torch.randn(ROUTER_PIECES_MIN_ROWS + 3, 512, device="cuda").bfloat16()
    got = router(x)
    assert torch.equal(got, router_logits_bf16(x, router.weight_pieces))
    torch.testing.assert_close(got, F.linear(x.float(), router.weight), rtol=1e-5, atol=1e-5)
    assert router.to(torch.bfloat16).weight_pieces is None and router.weight.dtype == torch.float32


def test_gumbel_draw_on_cuda_one_kernel_reproducible_and_shared_with_verification():
    """The sampler's draw on CUDA (deepinfer_kernels.sampling) equals torch's argmax over its noise, row by row
    whatever the batch, and speculative verification's draw of a row is the sampler's."""
    from deepinfer_kernels.sampling import gumbel_argmax, gumbel_noise
    from deepinfer_rt.sampler import gumbel_draw, stream_seed
    from deepinfer_rt.speculative.verify import DraftRow, _draw

    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(64, 129280, device="cuda", generator=g) * 3
    seeds, positions = list(range(64)), [3 * i for i in range(64)]
    tokens = gumbel_draw(z, seeds, positions)
    stream = torch.tensor([stream_seed(s, p) for s, p in zip(seeds, positions)], device="cuda")
    noise = gumbel_noise(stream, z.shape[1])
    assert torch.equal(tokens, (z - torch.log(-torch.log(noise))).argmax(-1))
    assert torch.equal(tokens, gumbel_argmax(z, stream))  # reproducible
    assert torch.equal(gumbel_draw(z[10:13], seeds[10:13], positions[10:13]), tokens[10:13])
    row = DraftRow.__new__(DraftRow)
    row.seed, row.num_output_tokens = seeds[5], positions[5]
    assert _draw(z[5], row) == tokens[5].item()
