"""Batch-invariant ops (CPU): a row's result is bitwise the same alone, at any place in any batch, and close to
the default op; the default ops are shown to lack this where they do."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deepinfer_kernels import reference
from triton_interpreter import INTERPRETER_ENV
from deepinfer_rt.cache.kv_pool import KVLayout, KVPool
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.layers import batch_invariant as bi
from deepinfer_rt.layers import invariant_gemm, methods
from deepinfer_rt.layers.kernel_config import KernelConfig
from deepinfer_rt.layers.attention.batch_invariant import BatchInvariantBackend, fixed_bmm, merge_blocks, ordered_sum
from deepinfer_rt.layers.attention.torch_ref import TorchRefBackend

INVARIANT = KernelConfig(is_batch_invariant=True)  # CPU
LINEAR, ACT = methods.linear_method(INVARIANT), methods.activation_method(INVARIANT)
NORM, HEAD = methods.norm_method(INVARIANT), methods.head_matmul_method(INVARIANT)
_BATCH_SIZES = (1, 2, 3, 7, 15, 16, 17, 33, 64, 100, 129, 300)  # 129, 300: large GEMM tiles and a tail


def _rows_invariant(fn, rows: torch.Tensor, seed: int = 0) -> bool:
    """fn on each row alone == fn on batches of random sizes holding that row at a random place."""
    gen = torch.Generator().manual_seed(seed)
    alone = torch.cat([fn(rows[i : i + 1]) for i in range(len(rows))])
    for m in _BATCH_SIZES:
        for i in range(0, len(rows), max(1, len(rows) // 4)):
            batch = torch.randn(m, *rows.shape[1:], generator=gen) * rows.std()
            at = int(torch.randint(m, (1,), generator=gen))
            batch[at] = rows[i]
            if not torch.equal(fn(batch)[at], alone[i]):
                return False
    return True


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 8), (40, 200)])
def test_linear_rows_invariant_and_close(k, n):
    gen = torch.Generator().manual_seed(k + n)
    w, b, x = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen), torch.randn(8, k, generator=gen)
    assert _rows_invariant(lambda t: LINEAR.linear(t, w, b), x)
    torch.testing.assert_close(LINEAR.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k_chunk", [None, 512])
def test_gemm_plans_rows_invariant_and_close(k_chunk):
    """Both GEMM forms (whole K, K in ordered slices), each over the call sizes found to agree: invariant, close
    to F.linear, and bitwise the same whichever agreeing sizes a cover picks (the timings only choose among
    forms that give the same bits)."""
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(576, 1536, generator=gen), torch.randn(4, 1536, generator=gen)
    k_chunk = k_chunk or 1536
    tiles = invariant_gemm.agreeing_sizes(torch.randn(512, 1536, generator=gen), w.t(), k_chunk,
                                          invariant_gemm.TILE_SIZES)
    assert invariant_gemm.REFERENCE_TILE in tiles
    by_size = invariant_gemm.GemmPlan(tiles, k_chunk)
    smallest = invariant_gemm.GemmPlan(tiles[:1], k_chunk)  # the same rows in calls of the smallest size only
    fn = lambda t: invariant_gemm.tiled_mm_with(t, w.t(), by_size)  # noqa: E731
    prompt = torch.cat([x] * 75)
    torch.testing.assert_close(fn(prompt), F.linear(prompt, w), rtol=1e-5, atol=1e-4)
    assert by_size.cover(300) != smallest.cover(300)
    assert torch.equal(fn(prompt), invariant_gemm.tiled_mm_with(prompt, w.t(), smallest))
    assert _rows_invariant(fn, x)


def _reverse_k_at(monkeypatch, rows_flipped):
    """Simulate a BLAS that rounds calls of some row counts differently: K summed in reverse there."""
    real_call = invariant_gemm._call

    def call(x_tile, w, k_chunk):
        if rows_flipped(len(x_tile)):
            return real_call(x_tile.flip(1), w.flip(1), k_chunk)
        return real_call(x_tile, w, k_chunk)

    monkeypatch.setattr(invariant_gemm, "_call", call)


def test_gemm_planner_falls_back_when_tile_sizes_disagree(monkeypatch):
    """Where every call of more than REFERENCE_TILE rows rounds differently, over the whole K and over K slices,
    the plan keeps the whole K and sizes up to REFERENCE_TILE, and the result stays invariant."""
    _reverse_k_at(monkeypatch, lambda rows: rows > invariant_gemm.REFERENCE_TILE)
    gen = torch.Generator().manual_seed(8)
    w, x = torch.randn(40, 1030, generator=gen), torch.randn(4, 1030, generator=gen)
    assert not invariant_gemm.tiles_agree(torch.randn(128, 1030, generator=gen), w.t(), 1030, 128)
    plan = invariant_gemm._plan.__wrapped__(40, 1030, torch.float32, True, 1)
    assert plan.k_chunk == 1030 and max(plan.tiles) == invariant_gemm.REFERENCE_TILE
    assert _rows_invariant(lambda t: invariant_gemm.tiled_mm_with(t, w.t(), plan), x)


def test_gemm_planner_drops_only_the_sizes_that_disagree(monkeypatch):
    """Where only 128-row calls round differently, the plan keeps the whole K and every other bulk size, and
    that plan is invariant and close to F.linear."""
    _reverse_k_at(monkeypatch, lambda rows: rows == 128)
    gen = torch.Generator().manual_seed(9)
    w, x = torch.randn(40, 1030, generator=gen), torch.randn(4, 1030, generator=gen)
    plan = invariant_gemm._plan.__wrapped__(40, 1030, torch.float32, True, 1)
    assert plan.k_chunk == 1030 and 128 not in plan.tiles and {64, 256} <= set(plan.tiles)
    assert _rows_invariant(lambda t: invariant_gemm.tiled_mm_with(t, w.t(), plan), x)
    prompt = torch.randn(300, 1030, generator=gen)
    torch.testing.assert_close(invariant_gemm.tiled_mm_with(prompt, w.t(), plan), F.linear(prompt, w),
                               rtol=1e-5, atol=1e-4)


def test_gemm_cover():
    """Calls of the largest size, then the rest in calls of one size, the fewest calls * CALL_ROWS + rows."""
    tiles = (4, 8, 16, 32, 64, 256)
    cover = lambda t: invariant_gemm.GemmPlan(tiles, 512).cover(t)  # noqa: E731
    assert cover(1) == (4,) and cover(8) == (8,) and cover(12) == (16,) and cover(256) == (256,)
    assert cover(298) == (256, 64)  # 42 rows: one call of 64, not three of 16
    assert invariant_gemm.GemmPlan((2, 4, 8, 16, 32, 256), 512).cover(298) == (256, 32, 32)
    assert all(sum(cover(t)) >= t for t in range(1, 700))
    w = torch.randn(5, 64)
    assert invariant_gemm.tiled_mm(torch.randn(0, 64), w.t()).shape == (0, 5)


def test_default_linear_is_not_batch_invariant():
    """The BLAS takes a GEMV path for one row and other kernels for more, so F.linear is not invariant."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 576, generator=gen), torch.randn(8, 576, generator=gen)
    assert not _rows_invariant(lambda t: F.linear(t, w), x)


def test_default_sigmoid_is_not_batch_invariant():
    """torch computes a thread's last elements with scalar code that rounds sigmoid/silu differently."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 4
    alone = torch.cat([x[i : i + 1].sigmoid() for i in range(len(x))])
    assert not torch.equal(alone, x.sigmoid())
    assert torch.equal(torch.cat([ACT.sigmoid(x[i : i + 1]) for i in range(len(x))]), ACT.sigmoid(x))


@pytest.mark.parametrize("width", [8, 17, 32, 128])
def test_elementwise_rows_invariant_and_close(width):
    x = torch.randn(16, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    assert _rows_invariant(ACT.silu_and_mul, x)
    assert _rows_invariant(ACT.sigmoid, x)
    torch.testing.assert_close(ACT.silu_and_mul(x), reference.silu_and_mul(x))
    torch.testing.assert_close(ACT.sigmoid(x), x.sigmoid())


@pytest.mark.parametrize("dim", [64, 576, 33000])  # one row of 33000 passes torch's parallel-reduction grain
def test_rms_norm_rows_invariant_and_close(dim):
    gen = torch.Generator().manual_seed(dim)
    x, w = torch.randn(6 if dim < 1000 else 1, dim, generator=gen), torch.rand(dim, generator=gen) + 0.5
    assert _rows_invariant(lambda t: NORM.rms_norm(t, w, 1e-5), x)
    torch.testing.assert_close(NORM.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


def test_row_softmax_and_argmax_invariant():
    """The sampler's row ops (log-softmax, softmax, argmax) are per-row kernels: invariant as they are."""
    x = torch.randn(2, 4099, generator=torch.Generator().manual_seed(1)) * 3
    assert _rows_invariant(lambda t: t.log_softmax(-1), x)
    assert _rows_invariant(lambda t: t.softmax(-1), x)
    assert _rows_invariant(lambda t: t.argmax(-1), x)


def test_head_matmul_rows_invariant_and_close():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 4, 16, generator=gen), torch.randn(4, 16, 24, generator=gen)
    assert _rows_invariant(lambda t: HEAD.apply(t, w), x)
    torch.testing.assert_close(HEAD.apply(x, w), torch.einsum("tha,hab->thb", x, w))


def test_fixed_bmm_entries_invariant():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 12, 64, generator=gen), torch.randn(5, 64, 64, generator=gen)
    alone = torch.cat([fixed_bmm(a[i : i + 1], b[i : i + 1]) for i in range(5)])
    for n in (5, 70, 130):
        big_a, big_b = torch.randn(n, 12, 64, generator=gen), torch.randn(n, 64, 64, generator=gen)
        big_a[-5:], big_b[-5:] = a, b
        assert torch.equal(fixed_bmm(big_a, big_b)[-5:], alone)
    torch.testing.assert_close(alone, torch.bmm(a, b))


# ---- attention ----

def _attend(backend, pool, q_all, seqs, layout):
    """seqs: list of (start, q_len) for sequences whose slots are 0.. in `layout` order; q_all[(seq, pos)]."""
    qs, q_lens, kv_lens, kv_slots = [], [], [], []
    for s, (start, q_len) in enumerate(seqs):
        qs.extend(q_all[s][start : start + q_len])
        q_lens.append(q_len)
        kv_lens.append(start + q_len)
        kv_slots.append(layout[s][: start + q_len])
    fb = ForwardBatch(input_ids=torch.zeros(len(qs), dtype=torch.long), positions=torch.zeros(len(qs)),
                      out_slots=torch.zeros(len(qs)), q_lens=q_lens, kv_lens=kv_lens, kv_slots=kv_slots,
                      pool=pool, backend=backend)
    backend.prepare(fb)
    out = backend.forward(torch.stack(qs), 0, 0.125, fb)
    return list(out.split(q_lens))


@pytest.mark.parametrize("mla", [False, True])
def test_attention_invariant_to_chunking_batching_and_close(mla):
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = (4, 1, 40) if mla else (6, 2, 16)
    layout_kv = KVLayout(1, (kv_heads, dim), None if mla else (kv_heads, dim), 32 if mla else dim)
    lens = [rng.randrange(1, 200) for _ in range(5)]
    pool = KVPool(layout_kv, sum(lens) + 8, 1, torch.float32, torch.device("cpu"))
    perm = torch.randperm(pool.num_slots, generator=gen)
    layout, start = [], 0
    for n in lens:
        layout.append(perm[start : start + n])
        start += n
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))
    if not mla:
        pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))
    q_all = [list(torch.randn(n, heads, dim, generator=gen)) for n in lens]
    backend = BatchInvariantBackend()
    # Reference result per sequence: one prefill of the whole sequence, alone.
    alone = [_attend(backend, pool, [q_all[s]], [(0, n)], [layout[s]])[0] for s, n in enumerate(lens)]
    expected = [_attend(TorchRefBackend(), pool, [q_all[s]], [(0, n)], [layout[s]])[0] for s, n in enumerate(lens)]
    for got, ref in zip(alone, expected):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for _ in range(6):  # every sequence cut into random chunks, chunks of different sequences batched together
        cuts = [sorted(rng.sample(range(1, n), min(n - 1, rng.randrange(0, 4)))) if n > 1 else [] for n in lens]
        pieces = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, lens)]
        got = [[] for _ in lens]
        for step in range(max(len(p) for p in pieces)):
            live = [s for s in range(len(lens)) if step < len(pieces[s])]
            rng.shuffle(live)
            outs = _attend(backend, pool, [q_all[s] for s in live],
                           [(pieces[s][step][0], pieces[s][step][1] - pieces[s][step][0]) for s in live],
                           [layout[s] for s in live])
            for s, o in zip(live, outs):
                got[s].append(o)
        for s in range(len(lens)):
            assert torch.equal(torch.cat(got[s]), alone[s])


def _block_items(gen: torch.Generator, num_blocks: int, rows_seen: int, heads: int = 2, rows: int = 3, dv: int = 5):
    """(m, l, o) of one tile's blocks: the first rows_seen rows see every block, the others only block 0."""
    m = torch.randn(heads, num_blocks, rows, generator=gen) * 4
    l = torch.rand(heads, num_blocks, rows, generator=gen) * 30 + 1
    o = torch.randn(heads, num_blocks, rows, dv, generator=gen) * 10
    m[:, 1:, rows_seen:], l[:, 1:, rows_seen:], o[:, 1:, rows_seen:] = float("-inf"), 0, 0
    return m, l, o


def test_merge_blocks_invariant_to_batch_and_unseen_blocks_and_close():
    """A tile's merged rows are bitwise the same among any other tiles (of any block counts), with blocks that
    none of its queries see appended, and equal to o / l exactly when the tile has one block."""
    gen = torch.Generator().manual_seed(9)
    target = _block_items(gen, 4, rows_seen=2)
    alone_l, alone_o = merge_blocks(torch.zeros(4, dtype=torch.long), torch.arange(4), 1, *target)
    m, l, o = (x.double() for x in target)
    big_m = m.amax(1, keepdim=True)
    torch.testing.assert_close(alone_l[:, 0], (l * (m - big_m).exp()).sum(1).float())
    torch.testing.assert_close(alone_o[:, 0], (o * (m - big_m).exp()[..., None]).sum(1).float())
    for trial in range(8):
        unseen = _block_items(gen, 1 + trial % 3, rows_seen=0)
        unseen[0][:, :, 1:], unseen[1][:, :, 1:], unseen[2][:, :, 1:] = float("-inf"), 0, 0
        mine = [torch.cat([a, b[:, 1:]], 1) for a, b in zip(target, unseen)]  # the tile plus unseen blocks
        tiles = [_block_items(gen, int(torch.randint(1, 6, (1,), generator=gen)), 1) for _ in range(3)]
        at = trial % 4
        tiles.insert(at, mine)
        item_tile = torch.cat([torch.full((t[0].shape[1],), i) for i, t in enumerate(tiles)])
        item_block = torch.cat([torch.arange(t[0].shape[1]) for t in tiles])
        got_l, got_o = merge_blocks(item_tile, item_block, len(tiles), *(torch.cat(x, 1) for x in zip(*tiles)))
        assert torch.equal(got_l[:, at], alone_l[:, 0]) and torch.equal(got_o[:, at], alone_o[:, 0])
    one = _block_items(gen, 1, rows_seen=0)
    one_l, one_o = merge_blocks(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 1, *one)
    assert torch.equal(one_l, one[1]) and torch.equal(one_o, one[2])


def test_ordered_sum_dense_form_matches_index_add(monkeypatch):
    """The dense block loop (non-CPU devices) adds in the same order as CPU index_add_: the same bits, signed
    zeros included."""
    gen = torch.Generator().manual_seed(10)
    counts = [3, 1, 5, 2]
    item_tile = torch.cat([torch.full((c,), i) for i, c in enumerate(counts)])
    item_block = torch.cat([torch.arange(c) for c in counts])
    x = torch.randn(2, len(item_tile), 3, 4, generator=gen) * 1e4
    x[:, ::3] = -0.0
    on_cpu = ordered_sum(x, item_tile, item_block, len(counts))
    monkeypatch.setattr(torch.Tensor, "is_cpu", property(lambda self: False))
    dense = ordered_sum(x, item_tile, item_block, len(counts))
    assert torch.equal(on_cpu, dense) and torch.equal(on_cpu.signbit(), dense.signbit())


# ---- Triton kernels, through Triton's CPU interpreter (small shapes) ----
# TRITON_INTERPRET is read when triton is imported, which may already have happened in this process, so the
# checks run in a fresh interpreter.

def _in_triton_interpreter(check: str) -> None:
    pytest.importorskip("triton")
    here = Path(__file__).resolve().parent
    env = dict(os.environ, **INTERPRETER_ENV,
               PYTHONPATH=os.pathsep.join([str(here), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    code = f"import torch; torch.set_num_threads(1); import {Path(__file__).stem} as t; t.{check}()"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def check_triton_matmul() -> None:
    from deepinfer_kernels import batch_invariant as kernels

    gen = torch.Generator().manual_seed(5)
    w_t, x = torch.randn(72, 40, generator=gen), torch.randn(3, 72, generator=gen)
    alone = torch.cat([kernels.matmul(x[i : i + 1], w_t) for i in range(3)])
    for m in (1, 70, 130, 600):  # 600: more than one GROUP_M band of row tiles
        batch = torch.randn(m + 3, 72, generator=gen)
        batch[m // 2 : m // 2 + 3] = x
        out = kernels.matmul(batch, w_t)
        assert torch.equal(out[m // 2 : m // 2 + 3], alone)
        torch.testing.assert_close(out, batch @ w_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, x @ w_t, rtol=1e-5, atol=1e-5)


def check_triton_rms_norm_and_silu() -> None:
    from deepinfer_kernels import batch_invariant as kernels

    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(5, 48, generator=gen), torch.rand(48, generator=gen) + 0.5
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(kernels.silu_and_mul(x), reference.silu_and_mul(x))
    for fn in (lambda t: kernels.rms_norm(t, w, 1e-6), kernels.silu_and_mul):
        alone = torch.cat([fn(x[i : i + 1]) for i in range(5)])
        assert torch.equal(fn(torch.cat([torch.randn(9, 48, generator=gen), x]))[9:], alone)


def test_triton_matmul_rows_invariant_and_close():
    _in_triton_interpreter("check_triton_matmul")


def test_triton_rms_norm_and_silu_close_and_invariant():
    _in_triton_interpreter("check_triton_rms_norm_and_silu")


def test_gated_mlp_columns_form_rows_invariant_and_close():
    """The CPU gated MLP that chains its GEMMs through columns (no transposes between them): a token's output
    is bitwise the same alone and in batches of any size (prefill-sized ones included), and close to the
    row-major form."""
    gen = torch.Generator().manual_seed(11)
    gate_up, down = torch.randn(2 * 96, 64, generator=gen) / 8, torch.randn(64, 96, generator=gen) / 10
    x = torch.randn(4, 64, generator=gen)
    assert _rows_invariant(lambda t: bi.gated_mlp(t, gate_up, down), x)
    ref = LINEAR.linear(ACT.silu_and_mul(LINEAR.linear(x, gate_up)), down)
    torch.testing.assert_close(bi.gated_mlp(x, gate_up, down), ref, rtol=1e-5, atol=1e-5)
    assert bi.gated_mlp(x[:0], gate_up, down).shape == (0, 64)
