"""Triton kernels whose logic can run on CPU through Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported, hence a subprocess): each against its torch form, exactly, or, for the fixed-split
attention, bitwise against itself in other batches and close to its reference. The GPU suite (test/gpu) runs
the same kernels compiled."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from triton_interpreter import INTERPRETER_ENV

pytest.importorskip("triton")

_ROUTER = textwrap.dedent("""
    import torch
    from deepinfer_kernels.moe_router import route
    from deepinfer_rt.layers.moe import select_experts
    for seed, (e, k, scoring, method, groups, kept, norm, scale) in enumerate([
            (64, 6, "softmax", "greedy", 1, 1, False, 1.0), (160, 6, "softmax", "group_limited_greedy", 8, 3, False, 16.0),
            (256, 8, "sigmoid", "noaux_tc", 8, 4, True, 2.5), (12, 3, "softmax", "greedy", 1, 1, True, 1.0)]):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(5, e, generator=g) * 3
        bias = torch.randn(e, generator=g) * 0.1 if method == "noaux_tc" else None
        kw = dict(scoring_func=scoring, topk_method=method, n_group=groups, topk_group=kept, correction_bias=bias,
                  norm_topk_prob=norm, routed_scaling_factor=scale)
        (w, ids), (ref_w, ref_ids) = route(logits, k, **kw), select_experts(logits, k, **kw)
        assert torch.equal(ids, ref_ids), method
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
        (w, ids), (ref_w, ref_ids) = route(logits, k, n_shared=2, **kw), select_experts(logits, k, n_shared=2, **kw)
        assert torch.equal(ids, ref_ids) and ids[:, k:].tolist() == [[e, e + 1]] * 5, method
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
    print("ok")
""")

# Batch-invariant fused MoE: three tokens alone, then inside batches of other sizes with random routing (one
# skewed so that an expert gets several row blocks), bitwise; and close to RoutedExperts' torch path. The
# interpreter multiplies bf16 tiles as their raw 16-bit integers, so 16-bit is checked in fp16 here.
_FUSED_MOE_INVARIANT = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_rt.layers.moe import RoutedExperts
    e, hidden, inter, k = 8, 64, 48, 3
    g = torch.Generator().manual_seed(0)
    experts = RoutedExperts(e, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(e, 2 * inter, hidden, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(e, hidden, inter, generator=g) * 0.1)

    def route(t, skew):
        scores = torch.rand(t, e, generator=g)
        scores[:, 0] += skew  # skew > 1: every token takes expert 0
        return torch.rand(t, k, generator=g) + 0.1, scores.topk(k, dim=-1).indices.sort(dim=-1).values

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
        gate_up, down = experts.gate_up_proj.detach().to(dtype), experts.down_proj.detach().to(dtype)
        moe = lambda x, w, ids: fused_moe(x, gate_up, down, w, ids, batch_invariant=True)
        x = torch.randn(3, hidden, generator=g).to(dtype)
        w, ids = route(3, 0.0)
        alone = torch.cat([moe(x[i : i + 1], w[i : i + 1], ids[i : i + 1]) for i in range(3)])
        for t, skew in ((4, 0.0), (9, 0.0), (45, 2.0)):
            bx, (bw, bids), at = torch.randn(t, hidden, generator=g).to(dtype), route(t, skew), t // 3
            bx[at : at + 3], bw[at : at + 3], bids[at : at + 3] = x, w, ids
            assert torch.equal(moe(bx, bw, bids)[at : at + 3], alone), (dtype, t)
        ref = experts(x.float(), w, ids)
        torch.testing.assert_close(alone.float(), ref, rtol=tol, atol=tol)
    print("ok")
""")

# Fixed-split attention with its split and tile scaled down (32 and 16 tokens) so the interpreter runs in
# seconds; the GPU suite runs the real sizes.
_SCALED_DOWN = """
    import torch
    from deepinfer_kernels import decode_attention as da
    da.FIXED_SPLIT_SIZE, da.FIXED_BLOCK_N = 32, 16
"""

# A row alone vs among random rows, in batches of other sizes with other grid split counts and launch chunks.
_FIXED_SPLITS = textwrap.dedent(_SCALED_DOWN + """
    for seed, (hq, hkv, dk, dv, ps) in enumerate([(4, 2, 32, 32, 4), (2, 1, 40, 32, 1)]):  # GQA; MLA, rope 8
        g = torch.Generator().manual_seed(seed)
        width = 80 // ps
        k = torch.randn(3 * width * ps, hkv, dk, generator=g)
        v = k[..., :dv] if hkv == 1 else torch.randn(3 * width * ps, hkv, dv, generator=g)
        table = torch.randperm(3 * width, generator=g).view(3, width).to(torch.int32)
        rows = torch.tensor([0, 1, 2, 1], dtype=torch.int32)
        lens = torch.tensor([70, 1, 0, 33], dtype=torch.int32)  # 70: three splits, the last one partial
        q = torch.randn(4, hq, dk, generator=g)
        splits = da.fixed_num_splits(width * ps)
        run = lambda q, r, n, s: da.paged_decode_attention_fixed(q, k, v, table, r, n, ps, dk**-0.5, s)
        alone = torch.cat([run(q[i : i + 1], rows[i : i + 1], lens[i : i + 1], splits) for i in range(4)])
        ref = da.paged_decode_attention_ref(q, k, v, table, rows, lens, ps, dk**-0.5)
        torch.testing.assert_close(alone, ref, rtol=1e-5, atol=1e-5)
        assert (alone[2] == 0).all()
        default = da.paged_decode_attention(q, k, v, table, rows, lens, ps, dk**-0.5, 2, block_n=16)
        torch.testing.assert_close(default, ref, rtol=1e-5, atol=1e-5)  # the default split kernel, same helpers
        one = da.paged_decode_attention(q, k, v, table, rows, lens, ps, dk**-0.5, 1, block_n=16)  # no merge
        torch.testing.assert_close(one, ref, rtol=1e-5, atol=1e-5)
        assert (one[2] == 0).all()  # an empty row
        if dk > dv:  # MLA: the query's rope part given apart gives the same bits in both kernels
            head, tail = q[..., :dv].clone(), q[..., dv:].clone()
            apart = da.paged_decode_attention(head, k, v, table, rows, lens, ps, dk**-0.5, 2, block_n=16, q_tail=tail)
            assert torch.equal(apart, default)
            fixed = da.paged_decode_attention_fixed(head, k, v, table, rows, lens, ps, dk**-0.5, splits, q_tail=tail)
            assert torch.equal(fixed, run(q, rows, lens, splits))
        for extra, more_splits, part_bytes in [(3, 2, 1 << 28), (1, 0, 1)]:  # part_bytes 1: a row per launch
            da._FIXED_PART_BYTES = part_bytes
            perm = torch.randperm(4 + extra, generator=g)
            bq = torch.randn(4 + extra, hq, dk, generator=g)
            br = torch.randint(0, 3, (4 + extra,), generator=g, dtype=torch.int32)
            bn = torch.randint(0, 40, (4 + extra,), generator=g, dtype=torch.int32)
            bq[perm[:4]], br[perm[:4]], bn[perm[:4]] = q, rows, lens
            out = run(bq, br, bn, splits + more_splits)
            assert torch.equal(out[perm[:4]], alone), (seed, extra, more_splits)
        da._FIXED_PART_BYTES = 1 << 28
        try:
            run(q, rows, lens, splits - 1)
            raise AssertionError("too few splits accepted")
        except ValueError:
            pass
    print("ok")
""")

# The backend (MLA-like: one latent KV head, V a prefix of K, rope part 8): a sequence's tokens attended in one
# prefill, in chunks (the prefix read back from the pool) and as decode rows next to another sequence give
# bitwise the same rows, close to causal attention in torch.
_INVARIANT_BACKEND = textwrap.dedent(_SCALED_DOWN + """
    from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.triton_invariant import TritonInvariantBackend
    hq, dk, dv, n = 2, 40, 32, 36  # n: two splits
    g = torch.Generator().manual_seed(0)
    backend = TritonInvariantBackend()
    pool = KVPool(KVLayout(1, (1, dk), None, dv), 100, 1, torch.float32, torch.device("cpu"))
    slots = torch.randperm(100, generator=g)[: 2 * n].view(2, n)  # disjoint: the pool is shared
    q, k = torch.randn(2, n, hq, dk, generator=g), torch.randn(2, n, 1, dk, generator=g)

    def attend(chunks):  # chunks: [(sequence, start, length)] run as one batch
        tok = lambda x: torch.cat([x[s, a : a + m] for s, a, m in chunks])
        fb = ForwardBatch(torch.zeros(sum(m for *_, m in chunks), dtype=torch.long),
                          torch.cat([torch.arange(a, a + m) for _, a, m in chunks]),
                          torch.cat([slots[s][a : a + m] for s, a, m in chunks]), [m for *_, m in chunks],
                          [a + m for _, a, m in chunks], [slots[s][: a + m] for s, a, m in chunks], pool, backend)
        backend.prepare(fb)
        return fb.attention(tok(q), tok(k), None, 0, dk**-0.5)

    whole = attend([(1, 0, 3), (0, 0, n)])[3:]
    parts = torch.cat([attend([(0, a, m), (1, 0, 1)])[:m] for a, m in [(0, 7), (7, 26), (33, 2)]])
    assert torch.equal(parts, whole[:35])
    for p in (31, 32, n - 1):
        assert torch.equal(attend([(1, 2, 1), (0, p, 1)])[1], whole[p]), p
    scores = torch.einsum("qhd,kd->hqk", q[0], k[0, :, 0]) * dk**-0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,kd->qhd", scores.softmax(-1), k[0, :, 0, :dv])
    torch.testing.assert_close(whole, ref, rtol=1e-5, atol=1e-5)
    print("ok")
""")


# MLA's fused per-token kernel (latent norm, rope of q_pe and k_pe, pool store) against the separate kernels, in
# both rope layouts, with a padding row (slot -1) that must store nothing.
_MLA_ROPE_STORE = textwrap.dedent("""
    import torch
    from deepinfer_kernels import elementwise as ew
    t, h, c, r, slots_total = 5, 3, 32, 16, 12
    for interleave in (False, True):
        g = torch.Generator().manual_seed(int(interleave))
        kv_a = torch.randn(t, c + r + 7, generator=g)[:, : c + r]  # a column slice of a wider row, as when merged
        q = torch.randn(t, h, 24 + r, generator=g)
        w, pos = torch.rand(c, generator=g) + 0.5, torch.randint(0, 64, (t,), generator=g)
        slots = torch.tensor([3, 0, -1, 11, 7])
        cos, sin = ew.rope_cache(1.0 / 10000 ** (torch.arange(0, r, 2) / r), 1.0, 64, torch.device("cpu"))
        pool = torch.full((slots_total, 1, c + r), 9.0)
        q_fused = q.clone()
        ew.mla_rope_store(kv_a, w, 1e-6, q_fused[..., 24:], pos, cos, sin, interleave, pool, slots)
        q_ref, k_pe = q.clone(), kv_a[:, c:].clone().view(t, 1, r)
        ew.apply_rope_(q_ref[..., 24:], pos, cos, sin, interleave)
        ew.apply_rope_(k_pe, pos, cos, sin, interleave)
        ref = torch.full_like(pool, 9.0)
        ew.store_kv(ref, slots, torch.cat([ew.rms_norm(kv_a[:, :c].contiguous(), w, 1e-6)[:, None], k_pe], dim=-1))
        assert torch.equal(q_fused, q_ref) and torch.equal(pool, ref), interleave
        assert (pool[[1, 2, 4, 5, 6, 8, 9, 10]] == 9).all()  # only the four real slots written
    print("ok")
""")


# The GQA per-token kernel (rope of q and k, store of k and v) against apply_rope_ and store_kv, in both rope
# layouts, over q / k / v column slices of one QKV row, with a padding row (slot -1) that must store nothing.
_GQA_ROPE_STORE = textwrap.dedent("""
    import torch
    from deepinfer_kernels import elementwise as ew
    t, hq, hkv, d, slots_total = 5, 9, 3, 16, 12
    for dtype in (torch.float32, torch.bfloat16):
        for interleave in (False, True):
            g = torch.Generator().manual_seed(int(interleave))
            qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
            pos = torch.randint(0, 64, (t,), generator=g)
            slots = torch.tensor([3, 0, -1, 11, 7])
            cos, sin = ew.rope_cache(1.0 / 10000 ** (torch.arange(0, d, 2) / d), 1.0, 64, torch.device("cpu"))
            def views(x):
                q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=1)
                return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            fused, ref = qkv.clone(), qkv.clone()
            kb, vb = torch.full((slots_total, hkv, d), 9.0, dtype=dtype), torch.full((slots_total, hkv, d), 9.0, dtype=dtype)
            kr, vr = kb.clone(), vb.clone()
            ew.gqa_rope_store(*views(fused), pos, cos, sin, interleave, kb, vb, slots)
            q, k, v = views(ref)
            ew.apply_rope_(q, pos, cos, sin, interleave)
            ew.apply_rope_(k, pos, cos, sin, interleave)
            ew.store_kv(kr, slots, k)
            ew.store_kv(vr, slots, v)
            assert torch.equal(fused, ref) and torch.equal(kb, kr) and torch.equal(vb, vr), (dtype, interleave)
            assert (kb[[1, 2, 4, 5, 6, 8, 9, 10]] == 9).all() and (vb[[1, 2, 4, 5, 6, 8, 9, 10]] == 9).all()
    print("ok")
""")


# Split-K decode over long rows: a grid of many splits, rows shorter than the grid (their extra splits empty,
# skipped by the merge) and a row of many tiles per split, against the torch reference; then the Triton
# backend decoding eagerly through the runner's device page table (page size 16) equals it through slot lists.
_LONG_DECODE = textwrap.dedent("""
    import torch
    import deepinfer_kernels.decode_attention as da
    from deepinfer_rt.cache.page_table import DevicePages
    from deepinfer_rt.forward_batch import ForwardBatch, TableSlots
    from deepinfer_rt.layers.attention.triton import TritonBackend
    g = torch.Generator().manual_seed(0)
    ps, hq, hkv, d = 16, 4, 2, 32
    lens = [0, 5, 40, 1500]
    width = -(-max(lens) // ps)
    k = torch.randn(width * len(lens) * ps, hkv, d, generator=g)
    v = torch.randn_like(k)
    table = torch.randperm(width * len(lens), generator=g).view(len(lens), width).to(torch.int32)
    rows = torch.tensor([2, 0, 3, 1], dtype=torch.int32)  # rows in another order than the batch
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    ref = da.paged_decode_attention_ref(q, k, v, table, rows, seq_lens, ps, d**-0.5)
    for splits in (1, 4, 32, 256):  # 256: the merge splits each head's 32 columns over two programs
        out = da.paged_decode_attention(q, k, v, table, rows, seq_lens, ps, d**-0.5, splits, block_n=16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert da.merge_block_d(256, 32) == 16 and da.merge_block_d(128, 512) == 32 and da.merge_block_d(4, 64) == 64
    assert da.num_splits_for(1, 1, 132, 576) == 128 and da.num_splits_for(16, 1, 132, 576) == 16
    assert [da.num_splits_for(b, 3, 132, 64) for b in (1, 4, 16, 64, 256)] == [256, 64, 16, 4, 1]  # GQA
    backend = object.__new__(TritonBackend)
    backend.num_sms, backend.pdl = 4, False

    class Pool:
        pass

    pool = Pool()
    pool.k, pool.v, pool.is_fp8 = [k], [v], False
    ids = torch.zeros(len(lens), dtype=torch.long)
    pages = DevicePages(table, rows, ps)
    listed = [pages.slots(int(r), n) for r, n in zip(rows, lens)]
    outs = []
    for kv_slots, p in ((TableSlots(pages, rows.tolist(), lens), pages), (listed, None)):
        fb = ForwardBatch(ids, ids, ids, [1] * len(lens), lens, kv_slots, pool, backend, pages=p)
        backend.prepare(fb)
        assert (fb.attn_meta.decode.page_table is table) == (p is not None)
        outs.append(backend.forward(q, 0, d**-0.5, fb))
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1], ref, rtol=1e-5, atol=1e-5)
    print("ok")
""")

# FP8 KV: rows quantized by the pool (one scale per slot and head), read by the default split kernel (1 and 3
# splits) and the fixed-split kernel, GQA and MLA (V a prefix of K, rope tail apart), against the torch reference
# on the dequantized rows; then the quantizing store kernel against KVPool.write's quantization, with a padding
# row (slot -1) that stores nothing.
_FP8_KV = textwrap.dedent(_SCALED_DOWN + """
    from deepinfer_kernels.elementwise import store_kv_fp8
    from deepinfer_rt.cache.kv_pool import quantize_fp8_rows
    for seed, (hq, hkv, dk, dv, ps) in enumerate([(4, 2, 32, 32, 4), (4, 1, 40, 32, 1)]):  # GQA; MLA, rope 8
        g = torch.Generator().manual_seed(seed)
        width = 80 // ps
        k32 = torch.randn(3 * width * ps, hkv, dk, generator=g) * (torch.rand(3 * width * ps, hkv, 1, generator=g) * 4)
        k, k_scale = quantize_fp8_rows(k32)
        if hkv == 1:
            v, v_scale = k[..., :dv], k_scale
        else:
            v, v_scale = quantize_fp8_rows(torch.randn(3 * width * ps, hkv, dv, generator=g))
        table = torch.randperm(3 * width, generator=g).view(3, width).to(torch.int32)
        rows = torch.tensor([0, 1, 2, 1], dtype=torch.int32)
        lens = torch.tensor([70, 1, 0, 33], dtype=torch.int32)
        q = torch.randn(4, hq, dk, generator=g)
        sc = dict(k_scale=k_scale, v_scale=v_scale)
        ref = da.paged_decode_attention_ref(q, k, v, table, rows, lens, ps, dk**-0.5, **sc)
        kd, vd = k.float() * k_scale[..., None], v.float() * v_scale[..., None]  # dequantized by hand
        torch.testing.assert_close(ref, da.paged_decode_attention_ref(q, kd, vd if hkv > 1 else kd[..., :dv], table,
                                                                      rows, lens, ps, dk**-0.5))
        for splits in (1, 3):
            out = da.paged_decode_attention(q, k, v, table, rows, lens, ps, dk**-0.5, splits, block_n=16, **sc)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            assert (out[2] == 0).all()
        fixed = da.paged_decode_attention_fixed(q, k, v, table, rows, lens, ps, dk**-0.5,
                                                da.fixed_num_splits(width * ps), **sc)
        torch.testing.assert_close(fixed, ref, rtol=1e-5, atol=1e-5)
        if dk > dv:
            apart = da.paged_decode_attention(q[..., :dv].clone(), k, v, table, rows, lens, ps, dk**-0.5, 3,
                                              block_n=16, q_tail=q[..., dv:].clone(), **sc)
            torch.testing.assert_close(apart, ref, rtol=1e-5, atol=1e-5)
        # 16-bit queries: fp16 dots for a bf16 query (the query rounds to fp16, a finer grid than bf16), and the
        # query's own dtype for an fp16 one (the interpreter's e4m3 -> bf16 conversion is not exact; the GPU test
        # checks that form in bf16)
        for dtype, kv_dot in ((torch.bfloat16, "f16"), (torch.float16, "query")):
            q16 = q.to(dtype)
            ref16 = da.paged_decode_attention_ref(q16.float(), k, v, table, rows, lens, ps, dk**-0.5, **sc)
            out = da.paged_decode_attention(q16, k, v, table, rows, lens, ps, dk**-0.5, 3, block_n=16,
                                            kv_dot=kv_dot, **sc)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), ref16, rtol=2e-2, atol=2e-2)
        try:
            da.paged_decode_attention(q, k, v, table, rows, lens, ps, dk**-0.5, 1, kv_dot="e4m3", **sc)
            raise AssertionError("unknown kv_dot accepted")
        except ValueError:
            pass
        try:
            da.paged_decode_attention(q, k, v, table, rows, lens, ps, dk**-0.5, 1)
            raise AssertionError("float8 buffers without scales accepted")
        except ValueError:
            pass
    g = torch.Generator().manual_seed(5)
    src = torch.randn(5, 3, 40, generator=g) * torch.rand(5, 3, 1, generator=g) * 10
    src[1, 2] = 0  # an all-zero row: scale at its floor, values 0
    src[3, 1, :4] = torch.tensor([-1e-6, 1e-6, -0.0, 0.0]) * src[3, 1].abs().max()  # to -0 / +0 after rounding
    buf = torch.zeros(9, 3, 40, dtype=torch.float8_e4m3fn)
    scale = torch.full((9, 3), 7.0)
    slots = torch.tensor([4, 0, -1, 8, 2])
    store_kv_fp8(buf, scale, slots, src)
    want, want_scale = quantize_fp8_rows(src)
    real = slots >= 0
    assert torch.equal(scale[slots[real]], want_scale[real])
    assert (scale[[1, 3, 5, 6, 7]] == 7).all() and (buf[[1, 3, 5, 6, 7]].float() == 0).all()
    # The kernel rounds on e4m3's grid in fp32 itself (so the interpreter's cast, which drops the carry when a
    # value rounds up to a power of two, never rounds): the stored bytes equal torch's, zero signs included.
    got, want = buf[slots[real]].view(torch.uint8), want[real].view(torch.uint8)
    assert torch.equal(got, want), (got != want).sum()
    assert (got[slots[real] == 8][0, 1, :4] == torch.tensor([128, 0, 128, 0], dtype=torch.uint8)).all()
    print("ok")
""")


def _interpret(code: str) -> str:
    """Run `code` in a Python whose Triton interprets its kernels; test/ is on its path (helpers.py)."""
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **INTERPRETER_ENV, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_moe_router_kernel_equals_torch_form():
    assert _interpret(_ROUTER).strip().endswith("ok")


def test_fused_moe_batch_invariant_kernels():
    assert _interpret(_FUSED_MOE_INVARIANT).strip().endswith("ok")


def test_fixed_split_attention_rows_invariant_and_close():
    assert _interpret(_FIXED_SPLITS).strip().endswith("ok")


def test_invariant_backend_prefill_chunks_and_decode_agree():
    assert _interpret(_INVARIANT_BACKEND).strip().endswith("ok")


def test_mla_rope_store_equals_separate_kernels():
    assert _interpret(_MLA_ROPE_STORE).strip().endswith("ok")


def test_gqa_rope_store_equals_separate_kernels():
    assert _interpret(_GQA_ROPE_STORE).strip().endswith("ok")


# A Llama attention layer through the Triton backend with the one-launch rope and store and without it (a fresh
# prompt, a decode row over cached keys, a padding row of slot -1): the same output and the same pool, bitwise.
_LLAMA_ROPE_STORE = textwrap.dedent("""
    import sys, tempfile, torch
    sys.path.insert(0, "scripts")
    from make_tiny_checkpoint import make_tiny_checkpoint
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.forward_batch import ForwardBatch
    from deepinfer_rt.layers.attention.triton import TritonBackend
    from deepinfer_rt.layers.kernel_config import KernelConfig, build_context
    from deepinfer_rt.models.llama import LlamaAttention, LlamaForCausalLM
    from deepinfer_rt.models.loader import load_model_config
    path = make_tiny_checkpoint("llama", tempfile.mkdtemp(), num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16)
    config, _ = load_model_config(path)
    torch.manual_seed(0)
    with build_context(KernelConfig(device_type="cuda")):  # the GPU's methods (Triton rope), run interpreted
        attn = LlamaAttention(config, 0)
    for p in attn.parameters():
        p.data.normal_(0, 0.2)
    def run(fused):
        pool = KVPool(LlamaForCausalLM.kv_layout(config), num_pages=64, page_size=1, dtype=torch.float32,
                      device=torch.device("cpu"))
        backend = object.__new__(TritonBackend)
        backend.num_sms, backend.is_rope_store_supported, backend.pdl = 4, fused, False
        torch.manual_seed(1)
        pool.k[0].normal_(), pool.v[0].normal_()
        x = torch.randn(7, config.hidden_size)
        batch = ForwardBatch(torch.zeros(7, dtype=torch.long), torch.tensor([0, 1, 2, 3, 4, 7, 0]),
                             torch.tensor([10, 11, 12, 13, 14, 27, -1]), [5, 1, 1], [5, 8, 1],
                             [torch.arange(10, 15), torch.arange(20, 28), torch.tensor([40])], pool, backend)
        backend.prepare(batch)
        with torch.no_grad():
            return attn(x, batch), pool.k[0].clone(), pool.v[0].clone()
    for got, want in zip(run(True), run(False)):
        assert torch.equal(got, want)
    print("ok")
""")


def test_llama_layer_with_rope_store_equals_without():
    assert _interpret(_LLAMA_ROPE_STORE).strip().endswith("ok")


# More query heads per KV head than one program takes (DeepSeek-V3's 128 MLA heads, a wide GQA group): the heads
# spread over programs (decode_attention.MLA_BLOCK_H / GQA_BLOCK_H), the default and the fixed-split kernels.
_MANY_HEADS = textwrap.dedent("""
    import torch
    import deepinfer_kernels.decode_attention as da
    g = torch.Generator().manual_seed(0)
    ps, lens = 4, [3, 70]
    table = torch.arange(2 * 18, dtype=torch.int32).view(2, 18)
    rows, seq_lens = torch.tensor([1, 0], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    for hq, hkv, dk, dv in ((40, 1, 288, 256), (160, 2, 32, 32)):  # MLA-wide (head 256 + tail 32), GQA of 80
        k = torch.randn(2 * 18 * ps, hkv, dk, generator=g)
        v = k[..., :dv] if hkv == 1 else torch.randn(2 * 18 * ps, hkv, dv, generator=g)
        q = torch.randn(len(lens), hq, dk, generator=g)
        layout = da._layout(q, k, v)
        assert layout["HEAD_BLOCKS"] == (3 if hkv == 1 else 2), layout
        ref = da.paged_decode_attention_ref(q, k, v, table, rows, seq_lens, ps, dk**-0.5)
        for splits in (1, 3, 8):  # the grid's splits: these over the head blocks (8 // 3 -> 2, 8 // 2 -> 4)
            out = da.paged_decode_attention(q, k, v, table, rows, seq_lens, ps, dk**-0.5, splits, block_n=16)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        out = da.paged_decode_attention_fixed(q, k, v, table, rows, seq_lens, ps, dk**-0.5,
                                             da.fixed_num_splits(18 * ps))
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    print("ok")
""")


def test_decode_attention_heads_past_one_program():
    assert _interpret(_MANY_HEADS).strip().endswith("ok")


def test_split_decode_long_rows_and_device_page_table():
    assert _interpret(_LONG_DECODE).strip().endswith("ok")


def test_fp8_kv_decode_and_store_kernels():
    assert _interpret(_FP8_KV).strip().endswith("ok")


# DeepSeek-V4's clamped SwiGLU in the fused MoE (swiglu_limit): against the experts' torch loop, with a limit that
# clamps most gate and up values; without a limit the kernel's result is unchanged. Through the invariant tiles (the
# same gate/up kernel, without the autotuner, which cannot time kernels in the interpreter).
_FUSED_MOE_CLAMPED = textwrap.dedent("""
    import torch
    from deepinfer_kernels.fused_moe import fused_moe
    from deepinfer_rt.models.deepseek_v4.moe import clamped_swiglu
    from deepinfer_rt.models.deepseek_v4.methods import v4_method
    from deepinfer_rt.layers.kernel_config import KernelConfig
    e, hidden, inter, k, limit = 8, 64, 48, 2, 0.05
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(e, 2 * inter, hidden, generator=g) * 0.1, torch.randn(e, hidden, inter, generator=g) * 0.1
    method = v4_method(KernelConfig.from_env(torch.device("cpu"), False, None))

    def loop(x, w, ids):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(k):
                gate, up = (gate_up[ids[t, j]] @ x[t]).chunk(2)
                out[t] += w[t, j] * (down[ids[t, j]] @ clamped_swiglu(gate, up, limit, method))
        return out

    moe = lambda *args, **kw: fused_moe(*args, batch_invariant=True, **kw)
    for t in (3, 20):
        x = torch.randn(t, hidden, generator=g)
        w, ids = torch.rand(t, k, generator=g), torch.rand(t, e, generator=g).topk(k, dim=-1).indices
        got = moe(x, gate_up, down, w, ids, swiglu_limit=limit)
        torch.testing.assert_close(got, loop(x, w, ids), rtol=1e-4, atol=1e-5)
        assert torch.equal(moe(x, gate_up, down, w, ids, swiglu_limit=None), moe(x, gate_up, down, w, ids))
        assert not torch.allclose(moe(x, gate_up, down, w, ids), got, atol=1e-6)  # the limit clamped
    print("ok")
""")


def test_fused_moe_clamped_swiglu_equals_torch_loop():
    assert _interpret(_FUSED_MOE_CLAMPED).strip().endswith("ok")
