"""DeepSeek-V4's sparse attention and indexer kernels reading FP8 e4m3 rows and their row scales directly
(kv_cache_dtype='fp8_e4m3'), under Triton's interpreter (a subprocess, as test_triton_interpreted.py), against the
torch references over the same rows dequantized (value * scale in fp32). Rows are quantized by the pool's own
Fp8Rows.write. Tolerances: fp32 queries 1e-5 (the kernel multiplies the scale into the scores instead of the
rows: rounding only); fp16 queries 2e-3 (attention) / 1e-3 (indexer), as the 16-bit kernels (the interpreter
multiplies bf16 tiles as raw integers, so 16-bit is checked in fp16). The fixed-split attention (batch-invariant
mode) gives a row bitwise the same output alone and inside batches of other sizes whose key lists are padded wider,
FP8 or not. The tiny V4 model on an FP8 compact pool: test_triton_v4_kernels.py."""
from __future__ import annotations

import textwrap

import pytest

from test_triton_interpreted import _interpret

pytest.importorskip("triton")

_QUANTIZE = """
    import torch
    from deepinfer_rt.models.deepseek_v4.common import Fp8Rows

    def fp8_rows(n, d, g, extra=0):
        # rows of widely different magnitudes (the scales matter), stored as the pool stores them; `extra`
        # columns make the values a column view of a wider row
        x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g).mul(8).add(0.05)
        rows = Fp8Rows.zeros(n, d + extra, torch.device("cpu"))
        rows.write(torch.arange(n), torch.nn.functional.pad(x, (0, extra)))
        values = rows.values[:, :d]
        deq = values.float() * rows.scales  # what V4Method reads (Fp8Rows.read) in fp32
        return values, rows.scales, deq
"""

# Two sources: FP8 with a per-query mask and -1 rows (scales (N, 1)), FP8 per-group or per-query rows (scales
# (N,)) or a 16-bit source beside an FP8 one; split and unsplit; a group that sees no key at all (zeros).
# fp32 tolerance 5e-5: rows dequantize up to ~8 in magnitude, so logits reach tens and their fp32 rounding (the
# order of the dot's sums, which differs between OpenBLAS kernels in the interpreter) moves outputs by ~2e-5.
_ATTENTION = textwrap.dedent(_QUANTIZE + """
    from deepinfer_kernels.v4_attention import KeySource, sparse_mqa_attention, sparse_mqa_attention_ref
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 5e-5), (torch.float16, 2e-3)):
        for G, Q, H, D, L1, L2, per_query, split, mixed in [(3, 1, 4, 32, 40, 20, False, None, False),
                                                            (1, 5, 4, 48, 37, 9, True, 32, False),
                                                            (2, 1, 16, 32, 70, 3, False, 32, True)]:
            v1, s1, d1 = fp8_rows(100, D, g, extra=8)
            v2, s2, d2 = fp8_rows(60, D, g)
            q = torch.randn(G, Q, H, D, generator=g).to(dtype)
            rows1 = torch.randint(0, 100, (G, L1), generator=g)
            rows1[0, -3:] = -1
            mask1 = torch.rand(G, Q, L1, generator=g) < 0.7
            mask1[-1] = False
            rows2 = torch.randint(-1, 60, (G, Q, L2) if per_query else (G, L2), generator=g)
            if G > 2:
                rows2[-1] = -1  # the last group sees nothing: zeros
            sink = torch.randn(H, generator=g)
            second = KeySource(d2.to(dtype), rows2) if mixed else KeySource(v2, rows2, scales=s2.view(-1))
            srcs = [KeySource(v1, rows1, mask1, scales=s1), second]
            out = sparse_mqa_attention(q, srcs, sink, D ** -0.5, split_len=split)
            ref = sparse_mqa_attention_ref(q, srcs, sink, D ** -0.5)
            by_hand = [KeySource(d1, rows1, mask1), KeySource(d2.to(dtype) if mixed else d2, rows2)]
            assert torch.equal(ref, sparse_mqa_attention_ref(q, by_hand, sink, D ** -0.5))
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            if G > 2:
                assert (out[-1] == 0).all()
            one = sparse_mqa_attention(q, srcs[:1], sink, D ** -0.5, split_len=split)
            torch.testing.assert_close(one.float(), sparse_mqa_attention_ref(q, srcs[:1], sink, D ** -0.5).float(),
                                       rtol=tol, atol=tol)
            fused = sparse_mqa_attention(q, srcs, sink, D ** -0.5, split_len=128, fuse=True)  # FP8 (+ 16-bit)
            torch.testing.assert_close(fused.float(), ref.float(), rtol=tol, atol=tol)
    for bad in (KeySource(v1, rows1, mask1), KeySource(v1, rows1, mask1, scales=s1[:50]),
                KeySource(d1.to(dtype), rows1, mask1, scales=s1)):
        try:
            sparse_mqa_attention(q, [bad], sink, D ** -0.5)
            raise AssertionError("FP8 rows without their scales (or scales without FP8 rows) accepted")
        except ValueError:
            pass
    print("ok")
""")

# FP8 index keys (a column view, -1 rows, visibility masks, no entries at all); then the top-k tie rule over the
# kernel's scores: two entries that name the same key row (in different entry tiles) score bitwise the same,
# and a k that cuts between them keeps the earlier one.
_INDEXER = textwrap.dedent(_QUANTIZE + """
    from deepinfer_kernels.reference import stable_topk
    from deepinfer_kernels.v4_indexer import index_scores, index_scores_ref
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for G, Q, H, Di, E, vis in [(3, 1, 4, 32, 70, True), (1, 6, 2, 48, 33, True), (2, 3, 16, 32, 64, False),
                                    (1, 2, 8, 16, 0, True)]:
            q = torch.randn(G, Q, H, Di, generator=g).to(dtype)
            w = torch.randn(G, Q, H, generator=g)
            values, scales, deq = fp8_rows(90, Di, g, extra=4)
            rows = torch.randint(-1, 90, (G, E), generator=g)
            visible = torch.rand(G, Q, E, generator=g) < 0.8 if vis else None
            out = index_scores(q, w, values, rows, visible, Di ** -0.5, scales)
            ref = index_scores_ref(q, w, values, rows, visible, Di ** -0.5, scales)
            assert torch.equal(ref, index_scores_ref(q, w, deq, rows, visible, Di ** -0.5))
            assert torch.equal(out.isinf(), ref.isinf())
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    G, Q, H, Di, E = 2, 3, 8, 32, 100
    q = torch.randn(G, Q, H, Di, generator=g)
    w = torch.rand(G, Q, H, generator=g)  # positive weights: no all-zero scores to tie by accident
    values, scales, _ = fp8_rows(G * E, Di, g)
    rows = torch.randperm(G * E, generator=g).view(G, E)
    rows[:, 70] = rows[:, 10]  # entry 70 names entry 10's key (another entry tile)
    visible = torch.ones(G, Q, E, dtype=torch.bool)
    visible[1, :, 90:] = False
    out = index_scores(q, w, values, rows, visible, Di ** -0.5, scales)
    ref = index_scores_ref(q, w, values, rows, visible, Di ** -0.5, scales)
    assert torch.equal(out[..., 10], out[..., 70])
    assert torch.equal(stable_topk(out, 16)[1], stable_topk(ref, 16)[1])  # no near-ties among the others
    for gi in range(G):
        for qi in range(Q):
            need = int((out[gi, qi] > out[gi, qi, 10]).sum()) + 1  # the tied value is the k-th best
            picks = stable_topk(out[gi, qi][None], need)[1][0].tolist()
            assert 10 in picks and 70 not in picks, (gi, qi)
    try:
        index_scores(q, w, values, rows, visible, Di ** -0.5)
        raise AssertionError("FP8 index keys without scales accepted")
    except ValueError:
        pass
    print("ok")
""")

# Fixed splits scaled down (64 keys, two tiles) so the needle's lists span several splits. The needle: a decode
# row (left-aligned sliding keys, then per-group entries with a mask) and a prefill query (per-query rows); the
# batches put it among random rows at another index, with lists padded to other widths (-1 rows, masked keys).
_FIXED = textwrap.dedent(_QUANTIZE + """
    from deepinfer_kernels import v4_attention as va
    from deepinfer_kernels.v4_attention import KeySource, sparse_mqa_attention, sparse_mqa_attention_ref
    va.FIXED_SPLIT_LEN = 64
    g = torch.Generator().manual_seed(3)
    H, D, N1, N2 = 4, 32, 400, 500
    v1, s1, d1 = fp8_rows(N1, D, g)
    v2, s2, d2 = fp8_rows(N2, D, g)

    def lists(n_valid, width, per_query_q, fill):
        # each row's valid keys at list positions 0 .. n - 1, then `fill` (-1 rows, or real rows masked off)
        rows = torch.full((len(n_valid), width), -1)
        mask = torch.zeros(len(n_valid), per_query_q, width, dtype=torch.bool)
        for i, n in enumerate(n_valid):
            rows[i, :n] = torch.randint(0, N1, (n,), generator=g)
            mask[i, :, :n] = torch.rand(per_query_q, n, generator=g) < 0.8
            if fill == "masked":
                rows[i, n:] = torch.randint(0, N1, (width - n,), generator=g)
        return rows, mask

    for dtype, fp8 in ((torch.float32, False), (torch.float16, False), (torch.float32, True)):
        b1 = v1 if fp8 else d1.to(dtype)
        b2 = v2 if fp8 else d2.to(dtype)
        kw1, kw2 = (dict(scales=s1), dict(scales=s2)) if fp8 else ({}, {})
        sink = torch.randn(H, generator=g)
        q = torch.randn(1, 1, H, D, generator=g).to(dtype)
        swa, swa_mask = lists([37], 37, 1, "none")
        ent = torch.randint(0, N2, (1, 150), generator=g)
        ent_mask = torch.rand(1, 1, 150, generator=g) < 0.7
        srcs = [KeySource(b1, swa, swa_mask, **kw1), KeySource(b2, ent, ent_mask, **kw2)]
        alone = sparse_mqa_attention(q, srcs, sink, D ** -0.5, fixed_splits=True)
        torch.testing.assert_close(alone.float(), sparse_mqa_attention_ref(q, srcs, sink, D ** -0.5).float(),
                                   rtol=2e-3, atol=2e-3)
        for G, at, w_swa, w_ent, fill in ((5, 2, 60, 300, "none"), (2, 1, 128, 150, "masked"), (9, 0, 37, 200, "none")):
            rows, mask = lists([int(torch.randint(1, w_swa + 1, (), generator=g)) for _ in range(G)], w_swa, 1, fill)
            rows[at], mask[at] = -1, False
            rows[at, :37], mask[at, :, :37] = swa[0], swa_mask[0]
            if fill == "masked":
                rows[at, 37:] = torch.randint(0, N1, (w_swa - 37,), generator=g)
            erows = torch.randint(0, N2, (G, w_ent), generator=g)
            emask = torch.rand(G, 1, w_ent, generator=g) < 0.7
            erows[at, :150], emask[at, :, :150], emask[at, :, 150:] = ent[0], ent_mask[0], False
            qb = torch.randn(G, 1, H, D, generator=g).to(dtype)
            qb[at] = q[0]
            batch = [KeySource(b1, rows, mask, **kw1), KeySource(b2, erows, emask, **kw2)]
            out = sparse_mqa_attention(qb, batch, sink, D ** -0.5, fixed_splits=True)
            assert torch.equal(out[at], alone[0]), (dtype, fp8, G)
        # a prefill query with per-query rows: alone (Q = 1) and as query 2 of 4, lists padded wider
        prow = torch.randint(0, N2, (1, 1, 130), generator=g)
        one = sparse_mqa_attention(q, [KeySource(b2, prow, **kw2)], sink, D ** -0.5, fixed_splits=True)
        rows4 = torch.randint(-1, N2, (1, 4, 190), generator=g)
        rows4[0, 2], rows4[0, 2, :130] = -1, prow[0, 0]
        q4 = torch.randn(1, 4, H, D, generator=g).to(dtype)
        q4[0, 2] = q[0, 0]
        four = sparse_mqa_attention(q4, [KeySource(b2, rows4, **kw2)], sink, D ** -0.5, fixed_splits=True)
        assert torch.equal(four[0, 2], one[0, 0]), (dtype, fp8)
    print("ok")
""")


def test_sparse_mqa_attention_reads_fp8_rows():
    assert _interpret(_ATTENTION).strip().endswith("ok")


def test_index_scores_read_fp8_rows_and_keep_the_tie_rule():
    assert _interpret(_INDEXER).strip().endswith("ok")


def test_fixed_split_attention_is_bitwise_the_same_in_any_batch():
    assert _interpret(_FIXED).strip().endswith("ok")


# Fp8Rows.write's CUDA form (one store_kv_fp8 launch) against its torch form, on the CPU through the interpreter:
# there the torch form divides amax by 448 exactly while the kernel multiplies by fp32(1/448) (as torch on CUDA
# does), so a scale may differ in its last bit and a value by one e4m3 step; rows not written stay zero. The GPU
# test (test_gpu_v4_kernels.py) checks the bits on CUDA.
_STORE_ROWS = textwrap.dedent("""
    import torch
    from deepinfer_rt.models.deepseek_v4.common import Fp8Rows
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, 40, generator=g) * torch.rand(5, 1, generator=g).mul(8).add(0.05)).to(dtype)
        x[2] = 0  # an all-zero row: the scale at its floor
        idx = torch.tensor([7, 0, 3, 9, 4])
        want, got = Fp8Rows.zeros(10, 40, torch.device("cpu")), Fp8Rows.zeros(10, 40, torch.device("cpu"))
        want.write(idx, x)
        got.store_rows(idx, x[:, :])
        torch.testing.assert_close(got.scales, want.scales, rtol=1e-6, atol=0)
        deq_w, deq_g = want.values.float() * want.scales, got.values.float() * got.scales
        torch.testing.assert_close(deq_g, deq_w, rtol=0.07, atol=1e-6)  # one e4m3 step at most
        unwritten = torch.tensor([1, 2, 5, 6, 8])
        assert (got.values[unwritten].float() == 0).all() and (got.scales[unwritten] == 0).all()
    print("ok")
""")


def test_fp8_rows_store_kernel_matches_torch_form():
    assert _interpret(_STORE_ROWS).strip().endswith("ok")
