"""Batch-invariant DeepSeek-V4 / V4.1 attention and indexer scores through the Triton kernels
(V4InvariantTritonMethod, V41InvariantTritonMethod), under Triton's interpreter (a subprocess, as
test_triton_interpreted.py), with the kernels' tiles and splits scaled down to 16 keys so that key lists span
several splits.

Method level (the fast test): a needle's last four positions alone (one prefill chunk), in prefill query blocks
of 2 beside another chunk and a decode row, then as decode rows (one was a prefill row alone) beside longer and
shorter sequences, whose entry lists pad the needle's wider. The needle's outputs (V4: each attention kind; V4.1:
attention over the sliding keys and selected entries, and the indexer scores; both over 16-bit and FP8 pool rows)
are bitwise the same in every composition: V4.1's selected entries come as the indexer's top-k indices (-1 past the chosen
ones, fewer than k in early rows) and the kernel's index form also agrees within 1e-5 with its mask form (every
entry of the group, the selection as the mask, fixed splits).

Model level (slow): the tiny models with the methods swapped in; a needle prompt alone (a prefill chunk, a
decode step) and cut into other chunks beside other sequences' chunks and decode rows; every needle logits row
the model outputs is bitwise the same in both runs (V4 and V4.1 on their compact pools, 16-bit and FP8).

Tolerance against V4InvariantMethod / V41InvariantMethod (torch, blocks of 64 keys merged in list order): in fp32
only the summation order of attention and of the indexer scores differs, so method outputs agree within 1e-5 and
the tiny models' logits within 1e-4."""
from __future__ import annotations

import textwrap

import pytest

from test_triton_interpreted import _interpret

pytest.importorskip("triton")

# Method level: the attention layers of the tiny V4 (window 20) over a LayerKV filled with random keys (FP8 rows
# or not); queries, indexer inputs and V4.1's selections are functions of (sequence, position). HCA's 18 entries,
# V4.1's 36 and the sliding lists of up to 20 keys span two or more 16-key splits.
_METHODS = textwrap.dedent("""
    from pathlib import Path

    import torch
    from deepinfer_kernels import v4_attention as va
    import helpers
    from deepinfer_rt.layers.kernel_config import KernelConfig
    from deepinfer_rt.models.deepseek_v4.batch import build_v4_batch
    from deepinfer_rt.models.deepseek_v4.common import Fp8Rows, LayerKV, PoolColumns
    from deepinfer_kernels.reference import stable_topk
    from deepinfer_rt.models.deepseek_v4 import invariant as v4_invariant
    from deepinfer_rt.models.deepseek_v4.methods import V4InvariantTritonMethod, key_source, v4_kernels
    from deepinfer_rt.models.deepseek_v41.methods import V41InvariantMethod, V41InvariantTritonMethod, picked_mask
    from deepinfer_rt.models.loader import build_model, load_model_config

    va.BLOCK_N = va.FIXED_SPLIT_LEN = 16
    torch.set_grad_enabled(False)
    path = Path(PATH)
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, torch.device("cpu"), seed=0,
                        kernel_config=KernelConfig(is_batch_invariant=True))
    cfg = model.model.cfg
    num_slots = 512
    g = torch.Generator().manual_seed(0)

    def sequences(n, a, b):
        # lengths, first pool slots, (q, x, q_residual) per position, and the needle's compositions over its last
        # four positions: alone (one prefill chunk), in query blocks of 2 beside another chunk and a decode row,
        # then as decode rows (its position n - 2 was a prefill row alone) beside longer and shorter sequences
        lengths = {"needle": n, "a": a, "b": b}
        table = {k: (torch.randn(m, cfg.num_heads, cfg.head_dim, generator=g),
                     torch.randn(m, cfg.hidden_size, generator=g), torch.randn(m, cfg.q_lora_rank, generator=g))
                 for k, m in lengths.items()}
        comps = [([("needle", n - 4, n)], 256),
                 ([("b", b - 3, b), ("needle", n - 5, n - 1), ("a", a - 1, a)], 2),
                 ([("a", a - 2, a - 1), ("needle", n - 2, n - 1), ("b", b - 1, b)], 256),
                 ([("b", b - 2, b - 1), ("a", a - 3, a - 2), ("needle", n - 1, n)], 256)]
        return lengths, {"needle": 0, "a": n + 8, "b": n + a + 16}, table, comps

    def chunk_batch(chunks, base):
        # chunks (sequence, start, end), each sequence's KV on consecutive slots from base[sequence]
        return helpers.chunk_batch([(None, torch.arange(base[n], base[n] + e), s, e) for n, s, e in chunks])

    lengths, base, table, compositions = sequences(144, 230, 40)  # HCA: 18 entries and more
    def layer_kv(layer_type, fp8):
        cols = PoolColumns.compact(cfg, layer_type, fp8)
        kv = LayerKV(torch.zeros(num_slots, cols.recent_width), torch.zeros(num_slots, cols.entry_width), cols,
                     *(Fp8Rows.zeros(num_slots, w, torch.device("cpu")) if fp8 and w else None
                       for w in (cfg.head_dim, cfg.head_dim * (layer_type != "sliding_attention"),
                                 cfg.index_head_dim * (layer_type == "compressed_sparse_attention"))))
        all_rows = torch.arange(num_slots)
        kv.store_swa(all_rows, torch.randn(num_slots, cfg.head_dim, generator=g))
        if layer_type != "sliding_attention":
            kv.store_entry(all_rows, torch.randn(num_slots, cfg.head_dim, generator=g))
        if layer_type == "compressed_sparse_attention":
            kv.store_idx_entry(all_rows, torch.randn(num_slots, cfg.index_head_dim, generator=g))
        return kv

    def attend(method, layer, kv, chunks, query_block):
        # chunks: (sequence, start, end) -> {(sequence, position): output (H, D)}
        batch = chunk_batch(chunks, base)
        vb = build_v4_batch(batch, cfg.sliding_window, cfg.ratios(), query_block)
        q, x, q_res = (torch.cat([table[n][i][s:e] for n, s, e in chunks]) for i in range(3))
        out = torch.full_like(q, float("nan"))
        for group in vb.groups:
            out[group.rows] = method.attend(layer, group, q, x, q_res, vb.positions, kv)
        keys = [(n, p) for n, s, e in chunks for p in range(s, e)]
        return dict(zip(keys, out))

    for fp8 in (False, True):
        # (the sliding layer's one source is also in the others: checked once, without FP8)
        for kind in ("compressed_sparse_attention", "heavily_compressed_attention") + ("sliding_attention",) * (not fp8):
            attn = model.model.layers[cfg.layer_types.index(kind)].attn
            kv = layer_kv(kind, fp8)
            reference = attn.method
            triton = V4InvariantTritonMethod(reference.linear, reference.activation, reference.head_matmul)
            seen = {}
            for method in (reference, triton):
                attn.method = method
                if attn.indexer is not None:
                    attn.indexer.method = method
                for chunks, block in compositions:
                    for (n, p), row in attend(method, attn, kv, chunks, block).items():
                        if n == "needle":
                            seen.setdefault((method is triton, p), []).append(row)
            attn.method = reference
            if attn.indexer is not None:
                attn.indexer.method = reference
            for p in range(140, 144):
                rows = seen[(True, p)]
                assert len(rows) >= 2 and all(torch.equal(r, rows[0]) for r in rows[1:]), (kind, fp8, p)
                torch.testing.assert_close(rows[0], seen[(False, p)][0], rtol=1e-5, atol=1e-5)

    # V4.1: the sliding keys and the ratio-1 / ratio-2 entries (a random selection, a function of the sequence,
    # the position and the entry), and the indexer scores over the entries' index keys.
    v4 = V4InvariantTritonMethod(model.model.layers[0].attn.method.linear, model.model.layers[0].attn.method.activation,
                                 model.model.layers[0].attn.method.head_matmul)
    reference, triton = V41InvariantMethod(v4), V41InvariantTritonMethod(v4)
    lengths, base, table, compositions = sequences(36, 50, 20)  # ratio 1: 36 entries
    di, hi = cfg.index_head_dim, cfg.index_n_heads
    swa_keys, entry_keys = torch.randn(num_slots, cfg.head_dim, generator=g), torch.randn(num_slots, cfg.head_dim,
                                                                                          generator=g)
    index_keys = torch.randn(num_slots, di, generator=g)
    d = cfg.head_dim
    v41_kv = {False: LayerKV(swa_keys, torch.cat([entry_keys, index_keys], dim=1),
                             PoolColumns(slice(0, d), *(slice(0, 0),) * 2, slice(0, d), *(slice(0, 0),) * 2,
                                         slice(d, d + di)))}
    empty = slice(0, 0)
    v41_kv[True] = LayerKV(torch.zeros(num_slots, 0), torch.zeros(num_slots, 0), PoolColumns(*(empty,) * 7),
                           *(Fp8Rows.zeros(num_slots, w, torch.device("cpu")) for w in (d, d, di)))
    v41_kv[True].store_swa(torch.arange(num_slots), swa_keys)
    v41_kv[True].store_entry(torch.arange(num_slots), entry_keys)
    v41_kv[True].store_idx_entry(torch.arange(num_slots), index_keys)
    sink = torch.randn(cfg.num_heads, generator=g)
    # V4.1's selection as the indexer gives it: a per-(position, entry) score, its stable top-12 among the chosen
    # visible entries, best first, -1 after them (early rows have fewer than 12; a wider batch only adds -1s)
    pick = {k: torch.rand(n, n, generator=g) < 0.5 for k, n in lengths.items()}  # (position, entry)
    rank = {k: torch.rand(n, n, generator=g) for k, n in lengths.items()}
    iq = {k: (torch.randn(n, hi, di, generator=g), torch.randn(n, hi, generator=g)) for k, n in lengths.items()}
    kernels, inf, fewer = v4_kernels(), float("inf"), False

    def per_row(table, names, pos, rows, num_e):
        # (rows, num_e): each row's table row at its position, cut or zero-padded to the group's entries
        return torch.stack([table[names[r]][pos[r], :num_e] if num_e <= lengths[names[r]] else
                            torch.nn.functional.pad(table[names[r]][pos[r]], (0, num_e - lengths[names[r]]))
                            for r in rows])

    for fp8 in (False, True):  # (ratio 2's entries reach the kernel as ratio 1's)
        ratio, kv, seen = 1, v41_kv[fp8], {}
        for method in (reference, triton):
            for chunks, block in compositions:
                batch = chunk_batch(chunks, base)
                vb = build_v4_batch(batch, cfg.sliding_window, (ratio,), block)
                q = torch.cat([table[n][0][s:e] for n, s, e in chunks])
                names = [n for n, s, e in chunks for _ in range(s, e)]
                pos = vb.positions
                for group in vb.groups:
                    rows = group.rows.tolist()
                    num_e = group.entry_slots[ratio].shape[1]
                    shape = (group.num_seqs, group.q_len, num_e)
                    sel = per_row(pick, names, pos, rows, num_e).view(shape) & group.entry_mask[ratio]
                    scores = per_row(rank, names, pos, rows, num_e).view(shape).masked_fill(~sel, -inf)
                    values, picks = stable_topk(scores, 12)
                    picks = picks.masked_fill(values == -inf, -1)
                    out = method.attend(q[group.rows], group, ratio, kv, kv, picks, sink)
                    if method is triton:  # the kernel's mask form: every entry of the group, the picks as mask
                        sources = [key_source(kernels, kv.fp8_swa, kv.recent[:, kv.cols.swa],
                                              v4_invariant.sliding_rows(group.swa_slots, group.swa_mask)),
                                   key_source(kernels, kv.fp8_entry, kv.entries[:, kv.cols.entry],
                                              group.entry_slots[ratio], picked_mask(picks, num_e))]
                        masked = va.sparse_mqa_attention(q[group.rows].view(group.num_seqs, group.q_len, -1, d),
                                                         sources, sink, d ** -0.5, fixed_splits=True)
                        torch.testing.assert_close(out, masked.view(out.shape), rtol=1e-5, atol=1e-5)
                        fewer |= bool((picks < 0).any() & (picks >= 0).any())
                    iqg = torch.stack([iq[names[r]][0][pos[r]] for r in rows]).view(group.num_seqs, group.q_len, hi, di)
                    w = torch.stack([iq[names[r]][1][pos[r]] for r in rows]).view(group.num_seqs, group.q_len, hi)
                    scores = method.index_scores(iqg, kv, group.entry_slots[ratio], w).reshape(len(rows), num_e)
                    for i, r in enumerate(rows):
                        if names[r] == "needle":
                            visible = int(group.entry_mask[ratio].reshape(len(rows), -1)[i].sum())
                            seen.setdefault((method is triton, int(pos[r])), []).append((out[i], scores[i, :visible]))
        for p in range(32, 36):
            rows = seen[(True, p)]
            assert len(rows) >= 2, (fp8, p)
            for out, scores in rows[1:]:
                assert torch.equal(out, rows[0][0]) and torch.equal(scores, rows[0][1]), (fp8, p)
            ref_out, ref_scores = seen[(False, p)][0]
            torch.testing.assert_close(rows[0][0], ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rows[0][1], ref_scores, rtol=1e-5, atol=1e-5)
    assert fewer  # some rows had fewer chosen entries than k
    print("ok")
""")

_SCRIPT = textwrap.dedent("""
    from pathlib import Path

    import torch
    from deepinfer_kernels import v4_attention as va
    from deepinfer_kernels import v4_indexer as vi
    from deepinfer_rt.cache.kv_pool import KVPool
    from deepinfer_rt.layers.kernel_config import KernelConfig
    from deepinfer_rt.models.deepseek_v4.methods import V4InvariantMethod, V4InvariantTritonMethod
    from deepinfer_rt.models.deepseek_v41.methods import V41InvariantMethod, V41InvariantTritonMethod
    from deepinfer_rt.models.loader import build_model, load_model_config
    from helpers import forward_chunks

    va.BLOCK_N = va.FIXED_SPLIT_LEN = 16
    path, fp8 = Path(PATH), FP8
    config, _ = load_model_config(path)
    model = build_model(config, path, "auto", torch.float32, torch.device("cpu"), seed=0,
                        kernel_config=KernelConfig(is_batch_invariant=True))
    gen = torch.Generator().manual_seed(1)
    lengths = {"needle": 33, "a": 52, "b": 14}
    tokens = {k: torch.randint(100, 20000, (n,), generator=gen) for k, n in lengths.items()}
    base = {k: 64 * i for i, k in enumerate(lengths)}
    calls = {"attention": 0, "index": 0}
    attention, index_scores = va.sparse_mqa_attention, vi.index_scores

    def counted_attention(*args, fixed_splits=False, **kw):
        assert fixed_splits
        calls["attention"] += 1
        return attention(*args, fixed_splits=fixed_splits, **kw)

    def counted_index(*args, fixed_order=False, **kw):
        assert fixed_order
        calls["index"] += 1
        return index_scores(*args, fixed_order=fixed_order, **kw)

    va.sparse_mqa_attention, vi.index_scores = counted_attention, counted_index

    def run(steps, query_block=256):
        # steps: per step, (sequence, start, end) chunks -> {(sequence, position): logits row}
        layout = model.kv_layout(config)
        pool = KVPool(layout.with_kv_dtype("fp8_e4m3") if fp8 else layout, 256, 1, torch.float32,
                      torch.device("cpu"))
        assert pool.layout.is_fp8 == fp8
        model.model.query_block = query_block
        rows = {}
        for chunks in steps:
            logits = torch.cat(forward_chunks(model, pool, [(tokens[n], torch.arange(base[n], base[n] + e), s, e)
                                                            for n, s, e in chunks]))
            r = 0
            for n, s, e in chunks:
                for p in range(s, e):
                    rows[(n, p)] = logits[r]
                    r += 1
        return rows

    alone_steps = [[("needle", 0, 32)], [("needle", 32, 33)]]
    mixed_steps = [[("a", 0, 20), ("needle", 0, 9)],
                   [("needle", 9, 31), ("b", 0, 12), ("a", 20, 50)],
                   [("a", 50, 51), ("b", 12, 13), ("needle", 31, 32)],  # 31: a decode row, a prefill row alone
                   [("b", 13, 14), ("needle", 32, 33), ("a", 51, 52)]]

    def needle(rows):
        return {p: v for (n, p), v in rows.items() if n == "needle"}

    reference = needle(run(alone_steps))  # V4InvariantMethod / V41InvariantMethod
    swapped = 0
    for mod in model.modules():
        m = getattr(mod, "method", None)
        if type(m) is V4InvariantMethod:
            mod.method = V4InvariantTritonMethod(m.linear, m.activation, m.head_matmul)
            swapped += 1
        elif type(m) is V41InvariantMethod:
            mod.method = V41InvariantTritonMethod(m.v4)
            swapped += 1
    assert swapped
    alone = needle(run(alone_steps))
    assert calls["attention"] > 0 and calls["index"] > 0, calls
    mixed = needle(run(mixed_steps, query_block=7))
    compared = 0
    for p, row in alone.items():
        if not (row.isfinite().all() and mixed[p].isfinite().all()):
            continue  # V4.1's YOCO prefill truncation leaves a chunk's early rows without an output (NaN)
        assert torch.equal(row, mixed[p]), p
        torch.testing.assert_close(row, reference[p], rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= MIN_ROWS, compared
    print("ok", compared)
""")


@pytest.fixture(scope="module")
def tiny_v4_window20(tmp_path_factory):
    """The tiny V4 with a sliding window of 20, so that a query's sliding list spans several 16-key splits."""
    from make_tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint("deepseek_v4", tmp_path_factory.mktemp("tiny-v4-w20"), seed=0, sliding_window=20)


def _script(path, fp8: bool, min_rows: int) -> str:
    return _SCRIPT.replace("PATH", repr(str(path))).replace("FP8", repr(fp8)).replace("MIN_ROWS", str(min_rows))


def test_v4_and_v41_invariant_triton_methods_bitwise_in_any_batch(tiny_v4_window20):
    assert _interpret(_METHODS.replace("PATH", repr(str(tiny_v4_window20)))).strip().endswith("ok")


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True])
def test_v4_invariant_triton_model_rows_bitwise_in_any_batch(tiny_v4_window20, fp8):
    assert _interpret(_script(tiny_v4_window20, fp8, 33)).strip().splitlines()[-1].startswith("ok")


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True])
def test_v41_invariant_triton_model_rows_bitwise_in_any_batch(tiny_v41_paths, fp8):
    assert _interpret(_script(tiny_v41_paths["a"], fp8, 2)).strip().splitlines()[-1].startswith("ok")
