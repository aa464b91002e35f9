"""DeepSeek-V4's Triton kernels (deepinfer_kernels.v4_attention / v4_indexer / v4_pooling) run on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported, hence a subprocess), each against its
torch reference (v4_sinkhorn too), and the tiny V4 model's logits with V4TritonMethod swapped in against
V4Method's (prefill chunks and decode rows in one batch), on a 16-bit and an FP8 pool. Tolerances: fp32 1e-5 (kernels) / 1e-4 (logits); fp16
2e-3 (the interpreter multiplies bf16 tiles as raw integers, so 16-bit is checked in fp16). The GPU suite
(test/gpu/test_gpu_v4_kernels.py) runs them compiled at V4-Flash shapes."""
from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer_kernels.reference import stable_topk
from test_triton_interpreted import _interpret

pytest.importorskip("triton")

# Two sources (a strided column view with a per-query mask and -1 rows; per-group or per-query rows without a
# mask), split and unsplit, a group that sees no key of one source, and a row that sees no key at all (zeros).
_ATTENTION = textwrap.dedent("""
    import torch
    from deepinfer_kernels.v4_attention import KeySource, sparse_mqa_attention, sparse_mqa_attention_ref
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for G, Q, H, D, L1, L2, per_query, split in [(3, 1, 4, 32, 40, 20, False, None),
                                                     (1, 5, 4, 48, 37, 9, True, 32), (2, 1, 16, 32, 70, 3, False, 32),
                                                     (2, 7, 2, 32, 12, 5, False, None)]:
            buf1 = torch.randn(100, D + 8, generator=g)[:, 4 : 4 + D].to(dtype)
            buf2 = torch.randn(60, D, generator=g).to(dtype)
            q = torch.randn(G, Q, H, D, generator=g).to(dtype)
            rows1 = torch.randint(0, 100, (G, L1), generator=g)
            rows1[0, -3:] = -1
            mask1 = torch.rand(G, Q, L1, generator=g) < 0.7
            mask1[-1] = False
            rows2 = torch.randint(-1, 60, (G, Q, L2) if per_query else (G, L2), generator=g)
            rows2[-1, ..., :] = -1 if G > 2 else rows2[-1]  # with G = 3 the last group sees nothing: zeros
            sink = torch.randn(H, generator=g)
            srcs = [KeySource(buf1, rows1, mask1), KeySource(buf2, rows2)]
            out = sparse_mqa_attention(q, srcs, sink, D ** -0.5, split_len=split)
            ref = sparse_mqa_attention_ref(q, srcs, sink, D ** -0.5)
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            if G > 2:
                assert (out[-1] == 0).all()
            one = sparse_mqa_attention(q, srcs[:1], sink, D ** -0.5, split_len=split)
            torch.testing.assert_close(one.float(), sparse_mqa_attention_ref(q, srcs[:1], sink, D ** -0.5).float(),
                                       rtol=tol, atol=tol)
            # One split a source (every list fits 128 keys): the fused kernel, one source or two, and the split
            # kernels with the combine for the same split, against the reference and each other.
            for some in (srcs, srcs[:1], srcs[1:]):
                ref_some = sparse_mqa_attention_ref(q, some, sink, D ** -0.5).float()
                fused = sparse_mqa_attention(q, some, sink, D ** -0.5, split_len=128, fuse=True)
                unfused = sparse_mqa_attention(q, some, sink, D ** -0.5, split_len=128, fuse=False)
                torch.testing.assert_close(fused.float(), ref_some, rtol=tol, atol=tol)
                torch.testing.assert_close(fused.float(), unfused.float(), rtol=tol, atol=tol)
                if G > 2:  # the last group sees no key of either source
                    assert (fused[-1] == 0).all()
            if max(L1, L2) > 32:
                try:
                    sparse_mqa_attention(q, srcs, sink, D ** -0.5, split_len=32, fuse=True)  # past one split
                    raise AssertionError("the fused kernel accepted a source that needs splits")
                except ValueError:
                    pass
    try:
        sparse_mqa_attention(q, [KeySource(buf2[:, :16], rows1, mask1)], sink, D ** -0.5)
        raise AssertionError("a key width other than the queries' accepted")
    except ValueError:
        pass
    print("ok")
""")

_INDEXER = textwrap.dedent("""
    import torch
    from deepinfer_kernels.reference import stable_topk, stable_topk_keys, topk_of_keys
    from deepinfer_kernels.v4_indexer import index_scores, index_scores_ref
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-3)):
        for G, Q, H, Di, E, vis in [(3, 1, 4, 32, 70, True), (1, 6, 2, 48, 33, True), (2, 3, 16, 32, 64, False),
                                    (1, 2, 8, 16, 0, True)]:
            q = torch.randn(G, Q, H, Di, generator=g).to(dtype)
            w = torch.randn(G, Q, H, generator=g)
            buf = torch.randn(90, Di + 4, generator=g)[:, :Di].to(dtype)
            rows = torch.randint(-1, 90, (G, E), generator=g)
            visible = torch.rand(G, Q, E, generator=g) < 0.8 if vis else None
            out = index_scores(q, w, buf, rows, visible, Di ** -0.5)
            ref = index_scores_ref(q, w, buf, rows, visible, Di ** -0.5)
            assert torch.equal(out.isinf(), ref.isinf())
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
            # The keys form: stable_topk's keys of the same scores, bit for bit, and their picks stable_topk's.
            keys = index_scores(q, w, buf, rows, visible, Di ** -0.5, as_keys=True)
            assert keys.dtype == torch.int64 and torch.equal(keys, stable_topk_keys(out))
            values, picks = stable_topk(out, 9)
            assert torch.equal(topk_of_keys(keys, 9), picks.masked_fill(values == float("-inf"), -1))
    # Ties, zeros of both signs and -inf rows: all-zero weights give +0.0 and -0.0 scores (w = -0.0) for every
    # entry, so the picks are the visible entries in index order.
    q = torch.randn(1, 2, 4, 16, generator=g)
    w = torch.zeros(1, 2, 4)
    w[0, 1] = -0.0
    rows = torch.tensor([[3, -1, 5, 7, 1, 2]])
    visible = torch.tensor([[[1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 0, 1]]], dtype=torch.bool)
    keys = index_scores(q, w, torch.randn(9, 16, generator=g), rows, visible, 0.25, as_keys=True)
    assert topk_of_keys(keys, 4).tolist() == [[[0, 3, 4, 5], [2, 3, 5, -1]]]
    assert topk_of_keys(keys[:, :, :0], 4).shape == (1, 2, 0)
    print("ok")
""")

_POOLING = textwrap.dedent("""
    import torch
    from deepinfer_kernels.v4_pooling import pool_window
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.float16, 1e-3)):
        for n, m, c in [(3, 4, 40), (2, 8, 200), (0, 4, 8)]:
            kv = torch.randn(n, m, c, generator=g).to(dtype)
            gate = torch.randn(n, m, c, generator=g) * 3
            if n:
                gate[0, : m // 2] = float("-inf")  # CSA's window 0: no previous window
            ref = (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)
            torch.testing.assert_close(pool_window(kv, gate).float(), ref.float(), rtol=tol, atol=tol)
    print("ok")
""")

# The gathered form against the torch form (V4Method.window_pool): CSA (overlap, window 0 without a predecessor)
# and HCA, windows over scattered pool rows, a pool row wider than the columns used, and no window at all.
_POOL_GATHERED = textwrap.dedent("""
    import torch
    from types import SimpleNamespace
    from deepinfer_kernels.v4_pooling import pool_gathered
    from deepinfer_rt.models.deepseek_v4.methods import V4Method
    torch_form = V4Method.__new__(V4Method)
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for overlap, m, d, n in [(True, 4, 40, 3), (False, 8, 24, 2), (True, 2, 16, 0)]:
            width = (2 if overlap else 1) * d
            buf = torch.randn(50, 7 + 2 * width + 5, generator=g).to(dtype)
            kv_cols, gate_cols = slice(7, 7 + width), slice(7 + width, 7 + 2 * width)
            cur = torch.randperm(50, generator=g)[: n * m].view(n, m)
            prev = torch.randint(0, 50, (n, m), generator=g)
            has_prev = torch.arange(n) > 0
            ape = torch.randn(m, width, generator=g)
            win = SimpleNamespace(cur=cur, prev=prev, has_prev=has_prev)
            ref = torch_form.window_pool(buf, kv_cols, gate_cols, win, ape, d, overlap)
            out = pool_gathered(buf, kv_cols.start, gate_cols.start, cur, prev, has_prev, ape, d, overlap)
            assert out.dtype == ref.dtype and out.shape == (n, d)
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            # V4.1's form: no position bias, the rows converted to fp32 and an fp32 result
            ref = torch_form.window_pool(buf, kv_cols, gate_cols, win, None, d, overlap, fp32=True)
            out = pool_gathered(buf, kv_cols.start, gate_cols.start, cur, prev, has_prev, None, d, overlap,
                                out_dtype=torch.float32)
            assert ref.dtype == out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    try:
        pool_gathered(buf, 7, 7 + width, cur, prev, has_prev, ape[:, :3], d, True)
        raise AssertionError("a position bias of the wrong width accepted")
    except ValueError:
        pass
    print("ok")
""")

_SINKHORN = textwrap.dedent("""
    import torch
    from deepinfer_kernels.v4_sinkhorn import sinkhorn
    from deepinfer_rt.models.deepseek_v4.methods import V4Method
    g = torch.Generator().manual_seed(0)
    for t, n, iters in [(5, 4, 20), (19, 2, 1), (3, 3, 7), (0, 4, 3)]:
        logits = torch.randn(t, n, n, generator=g) * 3
        ref = V4Method.sinkhorn(V4Method(None, None, None), logits, iters, 1e-6)
        torch.testing.assert_close(sinkhorn(logits, iters, 1e-6), ref, rtol=1e-6, atol=1e-6)
    print("ok")
""")

# The tiny V4 model (sliding, CSA with index_topk 3, HCA; window 6, ratios 4 / 8) on the compact pool, its rows
# 16-bit and then FP8 e4m3 (kv_cache_dtype='fp8_e4m3'): two prompts, then a chunk that does not align with the
# windows next to a decode row; V4TritonMethod (on FP8 rows, the kernels read them with their scales) against
# V4Method (which dequantizes the rows it gathers in torch).
_MODEL = textwrap.dedent("""
    from pathlib import Path

    import torch
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.models.deepseek_v4.cache import V4Pool
    from deepinfer_rt.models.deepseek_v4.methods import V4Method, V4TritonMethod
    from deepinfer_rt.models.loader import build_model, load_model_config
    from helpers import forward_chunks

    path = Path(PATH)
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, torch.device("cpu"), seed=0)
    tokens = [torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (29, 20)]
    fp8, calls = False, {}

    class Counting(V4TritonMethod):
        def attend(self, layer, g, q, x, q_residual, positions, kv):
            calls["attend"] += (kv.fp8_swa is not None) == fp8
            return super().attend(layer, g, q, x, q_residual, positions, kv)

        def index_select(self, indexer, q, keys, weights, visible):
            calls["select"] += (keys.scales is not None and keys.buf.dtype == torch.float8_e4m3fn) == fp8
            return super().index_select(indexer, q, keys, weights, visible)

    torch_forms = {mod: mod.method for mod in model.modules() if type(getattr(mod, "method", None)) is V4Method}

    def run(counted):
        for mod, m in torch_forms.items():
            mod.method = Counting(m.linear, m.activation, m.head_matmul) if counted else m
        layout = model.kv_layout(config)
        pool = KVPool(layout.with_kv_dtype("fp8_e4m3") if fp8 else layout, 200, 1, torch.float32,
                      torch.device("cpu"))
        assert isinstance(pool, V4Pool) and pool.layout.is_fp8 == fp8
        slots = [torch.arange(64 * i, 64 * i + len(t)) for i, t in enumerate(tokens)]
        return [forward_chunks(model, pool, [(tokens[i], slots[i], s, e) for i, s, e in chunks])
                for chunks in ([(0, 0, 13), (1, 0, 19)], [(0, 13, 29), (1, 19, 20)])]

    for fp8 in (False, True):
        calls.update(attend=0, select=0)
        ref, out = run(False), run(True)
        assert calls["attend"] > 0 and calls["select"] > 0, (fp8, calls)
        for a, b in zip(out, ref):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    print("ok")
""")


# The V4 norms (weighted, unweighted; one pass and the looped long row) and the rotation of the trailing channels
# (over middle dims, a strided view, and undone with -sin) and the clamped SwiGLU against the torch forms.
_ELEMENTWISE = textwrap.dedent("""
    import torch
    from deepinfer_kernels import v4_elementwise as ew
    from deepinfer_rt.models.deepseek_v4.methods import apply_rope
    from deepinfer_rt.models.deepseek_v4.methods import _rms_norm, _unweighted_rms_norm
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        for shape in ((5, 48), (3, 2, 64), (2, 3 * ew.MAX_BLOCK + 40)):
            x = (torch.randn(*shape, generator=g) * 3).to(dtype)
            w = torch.rand(shape[-1], generator=g) + 0.5
            torch.testing.assert_close(ew.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6), rtol=tol, atol=tol)
            torch.testing.assert_close(ew.rms_norm(x, None, 1e-6), _unweighted_rms_norm(x, 1e-6), rtol=tol, atol=tol)
            flat = ew.rms_norm(x, None, 1e-6, out_dtype=torch.float32)  # the hyper-connections' form
            assert flat.dtype == torch.float32
            torch.testing.assert_close(flat, _unweighted_rms_norm(x.float(), 1e-6), rtol=1e-5, atol=1e-5)
        for shape, half in (((4, 32), 8), ((3, 5, 48), 8), ((2, 17, 64), 32), ((3, 16), 8)):
            x = torch.randn(*shape, generator=g).to(dtype)
            cos, sin = torch.randn(shape[0], half, generator=g), torch.randn(shape[0], half, generator=g)
            want = apply_rope(x, cos, sin)
            got = ew.rope(x, cos, sin)
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert torch.equal(got[..., : shape[-1] - 2 * half], x[..., : shape[-1] - 2 * half])  # untouched
            wide = torch.randn(shape[0], *shape[1:-1], shape[-1] + 8, generator=g).to(dtype)[..., 4 : 4 + shape[-1]]
            torch.testing.assert_close(ew.rope(wide, cos, -sin), apply_rope(wide, cos, -sin), rtol=tol, atol=tol)
            # In place, on a view of a wider buffer: the rotated channels equal the copy's, the others and the
            # buffer's columns around the view stay as they were.
            buf = torch.randn(shape[0], *shape[1:-1], shape[-1] + 8, generator=g).to(dtype)
            before, view = buf.clone(), buf[..., 4 : 4 + shape[-1]]
            want = apply_rope(view, cos, sin)
            assert ew.rope(view, cos, sin, inplace=True).data_ptr() == view.data_ptr()
            torch.testing.assert_close(buf[..., 4 : 4 + shape[-1]], want, rtol=tol, atol=tol)
            nope = shape[-1] - 2 * half
            assert torch.equal(buf[..., : 4 + nope], before[..., : 4 + nope])
            assert torch.equal(buf[..., 4 + shape[-1] :], before[..., 4 + shape[-1] :])
        # The experts' clamped SwiGLU on the two halves of a gate | up product (views), limits that clamp some.
        gate_up = (torch.randn(5, 2 * 40, generator=g) * 4).to(dtype)
        gate, up = gate_up[:, :40], gate_up[:, 40:]
        for limit in (1.5, 7.3, 100.0):  # 7.3: off the fp16 grid
            want = torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
            torch.testing.assert_close(ew.clamped_swiglu(gate, up, limit), want, rtol=tol, atol=tol)
    print("ok")
""")


# V4's routing through the router kernel (V4TritonMethod.route: sqrt(softplus) scores, top k of scores + bias or the
# hash table's row, normalized and scaled) against V4Method.route: the same experts (ascending here, by biased score
# there) with the same weights; logits past softplus' linear threshold and far below zero included.
_ROUTE = textwrap.dedent("""
    import torch
    from types import SimpleNamespace
    from deepinfer_kernels import moe_router
    from deepinfer_rt.layers.methods import Activation, HeadMatmul, UnquantizedLinear
    from deepinfer_rt.models.deepseek_v4.methods import V4Method, V4TritonMethod
    g = torch.Generator().manual_seed(0)
    torch_m = V4Method(UnquantizedLinear(), Activation(), HeadMatmul())
    kernel_m = object.__new__(V4TritonMethod)
    kernel_m.linear, kernel_m.kernels, kernel_m.pdl = UnquantizedLinear(), SimpleNamespace(router=moe_router), False
    e, k, h, t = 24, 4, 32, 6
    for hashed in (False, True):
        router = SimpleNamespace(weight=torch.randn(e, h, generator=g), scoring_func="sqrtsoftplus", top_k=k,
                                 scaling=1.5, bias=torch.randn(e, generator=g) * 0.1,
                                 tid2eid=torch.randint(0, e, (50, k), generator=g) if hashed else None)
        x = torch.randn(t, h, generator=g) * 3
        x[0] *= 30  # logits past 20 and far below 0
        ids_in = torch.randint(0, 50, (t,), generator=g)
        (w, ids), (w_ref, ids_ref) = kernel_m.route(router, x, ids_in), torch_m.route(router, x, ids_in)
        if not hashed:  # the kernel lists the experts ascending
            ids_ref, order = ids_ref.sort(dim=-1)
            w_ref = w_ref.gather(1, order)
        assert torch.equal(ids, ids_ref), (hashed, ids, ids_ref)
        torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    print("ok")
""")


# The hyper-connection kernels against V4Method's forms: the mixes from the perceptron's logits (a token count
# past one program's block), the collapse and the spread, in fp32 and fp16 streams, N = 4 and 3; the logits.
_HYPER = textwrap.dedent("""
    import torch
    from deepinfer_kernels import v4_hyper as hk
    from deepinfer_rt.layers.methods import Activation, HeadMatmul, UnquantizedLinear
    from deepinfer_rt.models.deepseek_v4.methods import V4Method
    m = V4Method(UnquantizedLinear(), Activation(), HeadMatmul())
    g = torch.Generator().manual_seed(0)
    for n in (4, 3):
        t = hk.BLOCK_T + 5
        mix = torch.randn(t, (2 + n) * n, generator=g)
        base, scale = torch.randn((2 + n) * n, generator=g), torch.rand(3, generator=g) + 0.5
        for got, want in zip(hk.hc_weights(mix, base, scale, 20, 1e-6), m.hc_weights(mix, base, scale, n, 20, 1e-6)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        pre, post, comb = m.hc_weights(mix, base, scale, n, 20, 1e-6)
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            streams = torch.randn(t, n, hk.BLOCK_D + 40, generator=g).to(dtype)
            y = torch.randn(t, hk.BLOCK_D + 40, generator=g).to(dtype)
            torch.testing.assert_close(hk.hc_collapse(pre, streams), m.hc_collapse(pre, streams), rtol=tol, atol=tol)
            torch.testing.assert_close(hk.hc_expand(post, y, comb, streams), m.hc_expand(post, y, comb, streams),
                                       rtol=tol, atol=tol)
    # the mix logits in one pass: token counts of one and several token blocks (K split over more or fewer
    # programs), K off the step size, the mixes' 24 columns and the head's 4, fp32 / bf16 streams, bf16 weights
    for t, k, cols, dtype in ((1, 3 * 128 + 40, 24, torch.float32), (21, 1000, 4, torch.bfloat16),
                              (70, 640, 24, torch.bfloat16), (300, 256, 24, torch.float32),
                              (300, 2080, 24, torch.float32)):  # 22 splits of 3 steps, the last one short
        flat = (torch.randn(t, k, generator=g) * 3).to(dtype)
        w = torch.randn(cols, k, generator=g) * 0.05
        for weight in (w, w.bfloat16()):
            got, want = hk.hc_logits(flat, weight, 1e-6), m.hc_logits(flat, weight, 1e-6)
            assert got.dtype == torch.float32 and got.shape == (t, cols)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    print("ok")
""")


def test_v4_route_kernel_equals_torch_form():
    assert _interpret(_ROUTE).strip().endswith("ok")


def test_v4_hyper_connection_kernels_equal_torch_forms():
    assert _interpret(_HYPER).strip().endswith("ok")


def test_v4_norms_and_rope_equal_torch_forms():
    assert _interpret(_ELEMENTWISE).strip().endswith("ok")


def test_sparse_mqa_attention_equals_reference():
    assert _interpret(_ATTENTION).strip().endswith("ok")


def test_index_scores_equal_reference():
    assert _interpret(_INDEXER).strip().endswith("ok")


def test_pool_window_equals_torch_form():
    assert _interpret(_POOLING).strip().endswith("ok")


def test_pool_gathered_equals_torch_form():
    assert _interpret(_POOL_GATHERED).strip().endswith("ok")


def test_sinkhorn_equals_torch_form():
    assert _interpret(_SINKHORN).strip().endswith("ok")


def test_tiny_v4_logits_with_triton_method_equal_torch_method_16_bit_and_fp8_pool(tiny_v4_path):
    assert _interpret(_MODEL.replace("PATH", repr(str(tiny_v4_path)))).strip().endswith("ok")


def test_stable_topk_ties_to_the_earlier_entry():
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        x = torch.randint(-3, 3, (4, 50), generator=g).float() * 0.5
        x[x == -1.5] = float("-inf")
        x[x == 0.5] = -0.0  # -0.0 ties with +0.0, as a sort compares them
        values, picks = stable_topk(x, 17)
        ref = x.sort(dim=-1, descending=True, stable=True)
        assert torch.equal(picks, ref.indices[:, :17])
        assert torch.equal(values, ref.values[:, :17] + 0.0)
    assert stable_topk(x, 80)[1].shape == (4, 50)  # k past the row: the whole row, ordered
