"""DeepSeek-V4's Triton kernels at V4-Flash shapes against their torch references (CUDA only), and the V4 engine
on CUDA (where V4TritonMethod is the default) against the CPU engine.

Shapes: D = 512, H = 64 query heads, a sliding window of 128, top-k 512 / 2048 compressed entries, batch 1 and 64;
the indexer at 64 heads of 128 over 8192 entries (32K context at ratio 4); the compressor's pooling at ratio 4
(CSA, 2 x 4 tokens) and 128 (HCA); the norms, rotation and hyper-connection kernels against V4Method's forms.
Tolerances: fp32 pools take IEEE fp32 products, so outputs match the fp32 reference to 2e-5; bf16 pools multiply
bf16 tiles with fp32 accumulation and round p to bf16 for p.V (as the torch path rounds its probabilities), so
outputs are within 1.5e-2 relative (Frobenius) of the fp32 reference, under the bf16 torch path's own error.
FP8 key rows (kv_cache_dtype='fp8_e4m3', quantized by the pool's Fp8Rows.write) are checked against the same
references over the rows dequantized in fp32, at the same tolerances: the kernels convert e4m3 to the queries'
dtype exactly and apply the row scales to scores and probabilities in fp32. Their rows are spread over 0.05-8x
(values up to ~30), so the fp32 per-element bound is 2e-5 of the largest value row (the Frobenius bound stays 2e-5):
scaling the scores instead of the keys moves each logit by fp32 rounding of its size, and an output element by
that much of the rows it averages (3.5e-4 absolute at most on the H200, against values up to ~30).
"""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
D, H, WINDOW = 512, 64, 128


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _fp8(x: torch.Tensor):
    """x's rows as the compact pool stores them with kv_cache_dtype='fp8_e4m3': (values, scales (N, 1))."""
    from deepinfer_rt.models.deepseek_v4.common import Fp8Rows

    rows = Fp8Rows.zeros(x.shape[0], x.shape[1], x.device)
    rows.write(torch.arange(x.shape[0], device=x.device), x)
    return rows.values, rows.scales


def _as_fp8(sources):
    """The sources with their buffers in FP8 (row magnitudes spread so the scales matter), and the same rows
    dequantized in fp32 (for the references)."""
    fp8, deq = [], []
    for s in sources:
        spread = torch.linspace(0.05, 8.0, s.buf.shape[0], device=DEV)[torch.randperm(s.buf.shape[0], device=DEV)]
        values, scales = _fp8(s.buf.float() * spread[:, None])
        fp8.append(type(s)(values, s.rows, s.mask, scales))
        deq.append(type(s)(values.float() * scales, s.rows, s.mask))
    return fp8, deq


def _sources(batch: int, q_len: int, topk: int, dtype: torch.dtype, gen: torch.Generator):
    from deepinfer_kernels.v4_attention import KeySource

    pool = torch.randn(batch * (WINDOW + q_len) + 7, 3 * D, device=DEV, generator=gen).to(dtype)
    entries = torch.randn(batch * topk * 2, D, device=DEV, generator=gen).to(dtype)
    swa_len = WINDOW + q_len - 1
    swa_rows = torch.randperm(pool.shape[0], device=DEV, generator=gen)[: batch * swa_len].view(batch, swa_len)
    q_pos = torch.arange(WINDOW - 1, swa_len, device=DEV)[:, None]
    k_pos = torch.arange(swa_len, device=DEV)[None, :]
    swa_mask = ((k_pos <= q_pos) & (k_pos > q_pos - WINDOW))[None].expand(batch, q_len, swa_len).clone()
    swa_mask[0, :, : swa_len // 2] = False  # a short sequence
    picks = torch.randint(0, entries.shape[0], (batch, q_len, topk), device=DEV, generator=gen)
    picks[-1, :, topk - topk // 3 :] = -1  # fewer visible entries than topk
    return [KeySource(pool[:, D : 2 * D], swa_rows, swa_mask), KeySource(entries, picks)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,q_len,topk", [(1, 1, 512), (64, 1, 512), (1, 1, 2048), (64, 1, 2048), (1, 64, 512)],
                         ids=["decode1-512", "decode64-512", "decode1-2048", "decode64-2048", "prefill64-512"])
def test_sparse_mqa_attention_v4_flash(dtype, batch, q_len, topk):
    from deepinfer_kernels.v4_attention import sparse_mqa_attention, sparse_mqa_attention_ref

    gen = torch.Generator(device=DEV).manual_seed(batch * 7 + topk + q_len)
    sources = _sources(batch, q_len, topk, dtype, gen)
    q = torch.randn(batch, q_len, H, D, device=DEV, generator=gen).to(dtype)
    sink = torch.randn(H, device=DEV, generator=gen)
    out = sparse_mqa_attention(q, sources, sink, D ** -0.5)
    ref = sparse_mqa_attention_ref(q.float(), [type(s)(s.buf.float(), s.rows, s.mask) for s in sources], sink,
                                   D ** -0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    else:
        assert rel_err(out, ref) < 1.5e-2
    # the split choice does not matter beyond rounding: one split per source gives the same within tolerance,
    # through the fused kernel (the default there) and through the split kernels and the combine
    for fuse in (None, False):
        whole = sparse_mqa_attention(q, sources, sink, D ** -0.5, split_len=max(WINDOW + q_len, topk) + 32, fuse=fuse)
        assert rel_err(whole, ref) < (2e-5 if dtype == torch.float32 else 1.5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,q_len,topk", [(1, 1, 512), (64, 1, 512), (1, 1, 2048), (64, 1, 2048), (1, 64, 512),
                                              (256, 1, 512)],
                         ids=["decode1-512", "decode64-512", "decode1-2048", "decode64-2048", "prefill64-512",
                              "decode256-512"])  # batch 256: the fused kernel with 32 rows a program
def test_sparse_mqa_attention_v4_flash_fp8(dtype, batch, q_len, topk):
    from deepinfer_kernels.v4_attention import sparse_mqa_attention, sparse_mqa_attention_ref

    gen = torch.Generator(device=DEV).manual_seed(batch * 5 + topk + q_len)
    sources, deq = _as_fp8(_sources(batch, q_len, topk, torch.float32, gen))
    q = torch.randn(batch, q_len, H, D, device=DEV, generator=gen).to(dtype)
    sink = torch.randn(H, device=DEV, generator=gen)
    out = sparse_mqa_attention(q, sources, sink, D ** -0.5)
    ref = sparse_mqa_attention_ref(q.float(), deq, sink, D ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2
    assert rel_err(out, ref) < tol
    if dtype == torch.float32:  # per element: fp32 rounding of the logits, in units of the largest value row
        vmax = max(s.buf.abs().amax().item() for s in deq)
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5 * vmax)
    for fuse in (None, False):  # the fused kernel, and the split kernels with the combine, at one split a source
        whole = sparse_mqa_attention(q, sources, sink, D ** -0.5, split_len=max(WINDOW + q_len, topk) + 32, fuse=fuse)
        assert rel_err(whole, ref) < tol
    mixed = sparse_mqa_attention(q, [type(deq[0])(deq[0].buf.to(dtype), deq[0].rows, deq[0].mask), sources[1]],
                                 sink, D ** -0.5)  # a 16-bit source beside an FP8 one
    assert rel_err(mixed, ref) < tol


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("batch,q_len", [(1, 1), (64, 1), (1, 64)])
def test_index_scores_and_topk_v4_flash(batch, q_len, fp8):
    from deepinfer_kernels.reference import stable_topk, stable_topk_keys, topk_of_keys
    from deepinfer_kernels.v4_indexer import index_scores, index_scores_ref

    gen = torch.Generator(device=DEV).manual_seed(batch + q_len)
    hi, di, entries, topk = 64, 128, 8192, 512
    q = torch.randn(batch, q_len, hi, di, device=DEV, generator=gen).to(torch.bfloat16)
    w = torch.randn(batch, q_len, hi, device=DEV, generator=gen) * hi ** -0.5
    buf = torch.randn(batch * entries, 2 * di, device=DEV, generator=gen).to(torch.bfloat16)[:, :di]
    rows = torch.randperm(buf.shape[0], device=DEV, generator=gen).view(batch, entries)
    visible = (torch.arange(entries, device=DEV) < entries - 3 * torch.arange(q_len, device=DEV)[:, None])
    visible = visible[None].expand(batch, q_len, entries).clone()
    visible[0, :, entries // 2 :] = False
    scales = None
    if fp8:
        buf, scales = _fp8(buf.float() * torch.rand(buf.shape[0], 1, device=DEV, generator=gen).mul(8).add(0.05))
    out = index_scores(q, w, buf, rows, visible, di ** -0.5, scales)
    ref = index_scores_ref(q, w, buf, rows, visible, di ** -0.5, scales)
    assert torch.equal(out.isinf(), ref.isinf())
    # bf16 (and e4m3) products are exact in fp32; only the order of the fp32 sums, and where the scale is applied,
    # differ
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    values, picks = stable_topk(out, topk)
    ref_values = stable_topk(ref, topk)[0]
    # the same set up to near-ties: every pick's reference score reaches the reference k-th score
    chosen = ref.gather(-1, picks)
    assert (chosen >= ref_values[..., -1:] - 1e-4).all()
    assert torch.equal(stable_topk(out, topk)[1], picks)  # deterministic
    # The keys form (the engine's): the same keys as stable_topk builds from these scores, the same picks.
    keys = index_scores(q, w, buf, rows, visible, di ** -0.5, scales, as_keys=True)
    assert torch.equal(keys, stable_topk_keys(out))
    assert torch.equal(topk_of_keys(keys, topk), picks.masked_fill(values == float("-inf"), -1))


@pytest.mark.parametrize("m,c", [(8, 512), (128, 512), (8, 128)], ids=["csa", "hca", "csa-index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_window_v4_flash(m, c, dtype):
    from deepinfer_kernels.v4_pooling import pool_window

    gen = torch.Generator(device=DEV).manual_seed(m + c)
    kv = torch.randn(64, m, c, device=DEV, generator=gen).to(dtype)
    gate = torch.randn(64, m, c, device=DEV, generator=gen) * 4
    gate[0, : m // 2] = float("-inf")
    ref = (kv.float() * gate.softmax(dim=1)).sum(dim=1)
    out = pool_window(kv, gate)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("overlap,m,d", [(True, 4, 512), (False, 128, 512), (True, 4, 128)],
                         ids=["csa", "hca", "csa-index"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_gathered_v4_flash(overlap, m, d, dtype):
    """The compressor's gathers and pooling in one launch against V4Method's torch form, V4-Flash widths, 256
    windows over scattered rows of a compact-pool-like buffer (first window without a predecessor)."""
    from types import SimpleNamespace

    from deepinfer_kernels.v4_pooling import pool_gathered
    from deepinfer_rt.models.deepseek_v4.methods import V4Method

    gen = torch.Generator(device=DEV).manual_seed(m + d)
    width, n, rows = (2 if overlap else 1) * d, 256, 40000
    buf = torch.randn(rows, 512 + 2 * width, device=DEV, generator=gen).to(dtype)
    kv_cols, gate_cols = slice(512, 512 + width), slice(512 + width, 512 + 2 * width)
    cur = torch.randperm(rows, device=DEV, generator=gen)[: n * m].view(n, m)
    prev = torch.randint(0, rows, (n, m), device=DEV, generator=gen)
    has_prev = torch.arange(n, device=DEV) > 0
    ape = torch.randn(m, width, device=DEV, generator=gen)
    ref = V4Method.__new__(V4Method).window_pool(buf, kv_cols, gate_cols,
                                                 SimpleNamespace(cur=cur, prev=prev, has_prev=has_prev), ape, d,
                                                 overlap)
    out = pool_gathered(buf, kv_cols.start, gate_cols.start, cur, prev, has_prev, ape, d, overlap)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(out, ref) < 1e-2
    # V4.1's form: no position bias, fp32 rows and result
    ref = V4Method.__new__(V4Method).window_pool(buf, kv_cols, gate_cols,
                                                 SimpleNamespace(cur=cur, prev=prev, has_prev=has_prev), None, d,
                                                 overlap, fp32=True)
    out = pool_gathered(buf, kv_cols.start, gate_cols.start, cur, prev, has_prev, None, d, overlap,
                        out_dtype=torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_rope_and_hyper_connections_v4_flash(dtype):
    """The glue kernels at V4-Flash widths against V4Method's torch forms on the same GPU: the norms over 4096
    (hidden), 512 (heads) and the hyper-connections' flattened 4 x 4096 streams (a looped row), the rotation of
    the trailing 64 of 512 channels over 64 heads, and the hyper-connections' mix logits, mixes, collapse and
    spread."""
    from deepinfer_kernels import v4_elementwise as ew
    from deepinfer_kernels import v4_hyper as hk
    from deepinfer_rt.layers.methods import Activation, HeadMatmul, UnquantizedLinear
    from deepinfer_rt.models.deepseek_v4.methods import apply_rope
    from deepinfer_rt.models.deepseek_v4.methods import V4Method, _rms_norm, _unweighted_rms_norm

    m = V4Method(UnquantizedLinear(), Activation(), HeadMatmul())

    def check(got, want):  # bf16: the two round differently (fused products, sum order), so a relative bound
        assert got.dtype == want.dtype and got.shape == want.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert rel_err(got.float(), want.float()) < 5e-3

    gen = torch.Generator(device=DEV).manual_seed(0)
    for shape in ((64, 4096), (64, H, D), (64, 4 * 4096)):
        x = (torch.randn(*shape, device=DEV, generator=gen) * 3).to(dtype)
        w = torch.rand(shape[-1], device=DEV, generator=gen) + 0.5
        check(ew.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6))
        check(ew.rms_norm(x, None, 1e-6), _unweighted_rms_norm(x, 1e-6))
    x = torch.randn(64, H, D, device=DEV, generator=gen).to(dtype)
    cos, sin = (torch.randn(64, 32, device=DEV, generator=gen) for _ in range(2))
    check(ew.rope(x, cos, sin), apply_rope(x, cos, sin))
    check(ew.rope(x, cos, -sin), apply_rope(x, cos, -sin))
    want = apply_rope(x, cos, sin)
    check(ew.rope(x, cos, sin, inplace=True), want)  # in place: x itself rotated
    check(x, want)
    n, t = 4, 64
    mix = torch.randn(t, (2 + n) * n, device=DEV, generator=gen)
    base, scale = torch.randn((2 + n) * n, device=DEV, generator=gen), torch.rand(3, device=DEV, generator=gen) + 0.5
    for got, want in zip(hk.hc_weights(mix, base, scale, 20, 1e-6), m.hc_weights(mix, base, scale, n, 20, 1e-6)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    pre, post, comb = m.hc_weights(mix, base, scale, n, 20, 1e-6)
    streams = torch.randn(t, n, 4096, device=DEV, generator=gen).to(dtype)
    y = torch.randn(t, 4096, device=DEV, generator=gen).to(dtype)
    check(hk.hc_collapse(pre, streams), m.hc_collapse(pre, streams))
    check(hk.hc_expand(post, y, comb, streams), m.hc_expand(post, y, comb, streams))
    # the mix logits in one pass (K split over programs) against the fp32 norm and GEMM: V4-Flash's and V4.1-Flash's
    # flattened streams, the mixes' 24 columns and the head's 4, one decode token to a prefill chunk's worth
    for t, width, cols in ((1, 4 * 4096, 24), (64, 4 * 5120, 24), (256, 4 * 4096, 4), (2048, 4 * 5120, 24)):
        flat = (torch.randn(t, width, device=DEV, generator=gen) * 3).to(dtype)
        fn = torch.randn(cols, width, device=DEV, generator=gen) * 0.02
        got, want = hk.hc_logits(flat, fn, 1e-6), m.hc_logits(flat, fn, 1e-6)
        assert got.dtype == torch.float32 and got.shape == (t, cols)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (t, (got - want).abs().max())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_gpu_v4_engine_with_triton_method_matches_cpu(tmp_path_factory, kv_cache_dtype):
    from make_tiny_checkpoint import _tokenizer_dir, make_tiny_checkpoint

    from deepinfer_rt import Engine, SamplingParams
    from deepinfer_rt.models.deepseek_v4.methods import V4TritonMethod

    path = make_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4"), seed=0,
                                tokenizer_dir=_tokenizer_dir("deepseek_v2"))
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=True, ignore_eos=True)
    kw = dict(dtype="float32", kv_cache_tokens=4096, max_num_seqs=8, chunked_prefill_tokens=11,
              kv_cache_dtype=kv_cache_dtype)
    rng = random.Random(3)
    with Engine(str(path), device="cpu", **kw) as cpu:
        prompts = [[rng.randrange(cpu.model_config.vocab_size) for _ in range(n)] for n in (3, 29, 61)]
        ref = cpu.generate(input_ids=prompts, sampling_params=greedy)
    with Engine(str(path), device="cuda", **kw) as gpu:
        attn = gpu.model.model.layers[1].attn
        assert isinstance(attn.method, V4TritonMethod) and attn.indexer is not None
        assert (attn.layer_kv(gpu.pool).fp8_entry is not None) == (kv_cache_dtype == "fp8_e4m3")
        out = gpu.generate(input_ids=prompts, sampling_params=greedy)
    for o, r in zip(out, ref):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_write_on_cuda_bitwise_equals_torch_form(dtype):
    """Fp8Rows.write on CUDA (one store_kv_fp8 launch) stores the bits of its torch form run on CUDA, at V4-Flash's
    512-wide rows, scattered rows, an all-zero row."""
    from deepinfer_rt.models.deepseek_v4.common import FP8_MAX, Fp8Rows

    gen = torch.Generator(device=DEV).manual_seed(1)
    x = (torch.randn(300, 512, device=DEV, generator=gen) * torch.rand(300, 1, device=DEV, generator=gen) * 9).to(dtype)
    x[5] = 0
    idx = torch.randperm(1000, device=DEV, generator=gen)[:300]
    got = Fp8Rows.zeros(1000, 512, torch.device(DEV))
    got.write(idx, x)
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    want = Fp8Rows.zeros(1000, 512, torch.device(DEV))
    want.values[idx] = (xf / scale).to(torch.float8_e4m3fn)
    want.scales[idx] = scale
    assert torch.equal(got.scales, want.scales)
    assert torch.equal(got.values.view(torch.uint8), want.values.view(torch.uint8))
