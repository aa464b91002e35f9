"""KV pool on CPU: the refcounted page allocator (hypothesis), slot addressing, GQA and MLA buffers."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_rt.cache.kv_pool import KVLayout, KVPool, PageAllocator, num_kv_pages, slots_of

CPU = torch.device("cpu")


def check_allocator(alloc: PageAllocator, model: dict[int, int]) -> None:
    """`model` maps page -> expected refcount for every referenced page."""
    free = alloc._free
    assert len(free) == len(set(free)), "a page is on the free list twice"
    referenced = {p for p in range(alloc.num_pages) if alloc.refcount(p) > 0}
    assert not referenced & set(free), "a page is both free and referenced"
    assert alloc.num_free + len(referenced) == alloc.num_pages
    assert set(free) | referenced == set(range(alloc.num_pages))
    assert {p: alloc.refcount(p) for p in referenced} == model
    assert all(alloc.refcount(p) >= 0 for p in range(alloc.num_pages))


# Operations: ("alloc", n) | ("incref", i) | ("decref", i) | ("decref_free", i) | ("incref_free", i)
ops_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, 6)),
        st.tuples(st.just("incref"), st.integers(0, 10_000)),
        st.tuples(st.just("decref"), st.integers(0, 10_000)),
        st.tuples(st.just("decref_many"), st.integers(0, 10_000)),
        st.tuples(st.just("decref_free"), st.integers(0, 10_000)),
        st.tuples(st.just("incref_free"), st.integers(0, 10_000)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 12), ops=ops_strategy)
def test_allocator_invariants_under_random_ops(num_pages, ops):
    alloc = PageAllocator(num_pages)
    model: dict[int, int] = {}
    check_allocator(alloc, model)
    for op, arg in ops:
        held = sorted(model)
        free = sorted(set(range(num_pages)) - set(model))
        if op == "alloc":
            before = (list(alloc._free), [alloc.refcount(p) for p in range(num_pages)])
            pages = alloc.alloc(arg)
            if arg > len(free):
                assert pages is None
                assert (list(alloc._free), [alloc.refcount(p) for p in range(num_pages)]) == before
            else:
                assert pages is not None and len(pages) == arg and len(set(pages)) == arg
                assert set(pages) <= set(free), "alloc handed out a referenced page"
                for p in pages:
                    model[p] = 1
        elif op == "incref" and held:
            p = held[arg % len(held)]
            alloc.incref([p])
            model[p] += 1
        elif op == "decref" and held:
            p = held[arg % len(held)]
            alloc.decref([p])
            model[p] -= 1
            if model[p] == 0:
                del model[p]
        elif op == "decref_many" and held:
            # release a whole request's page list at once
            pages = held[arg % len(held):]
            alloc.decref(pages)
            for p in pages:
                model[p] -= 1
                if model[p] == 0:
                    del model[p]
        elif op == "decref_free" and free:
            p = free[arg % len(free)]
            with pytest.raises(AssertionError):
                alloc.decref([p])
        elif op == "incref_free" and free:
            p = free[arg % len(free)]
            with pytest.raises(AssertionError):
                alloc.incref([p])
        check_allocator(alloc, model)


def test_alloc_hands_out_low_ids_first_and_reuses_freed_pages():
    alloc = PageAllocator(6)
    assert alloc.alloc(3) == [0, 1, 2]
    assert alloc.num_free == 3
    alloc.decref([1])
    assert alloc.num_free == 4
    again = alloc.alloc(4)
    assert again is not None and sorted(again) == [1, 3, 4, 5]
    assert alloc.num_free == 0
    assert alloc.alloc(1) is None
    assert alloc.alloc(0) == []


def test_alloc_short_returns_none_and_changes_nothing():
    alloc = PageAllocator(4)
    first = alloc.alloc(3)
    assert first == [0, 1, 2]
    state = (list(alloc._free), [alloc.refcount(p) for p in range(4)])
    assert alloc.alloc(2) is None
    assert (list(alloc._free), [alloc.refcount(p) for p in range(4)]) == state
    assert alloc.alloc(1) == [3]


def test_shared_page_freed_only_by_last_holder():
    alloc = PageAllocator(2)
    pages = alloc.alloc(2)
    alloc.incref(pages[:1])
    assert alloc.refcount(pages[0]) == 2
    alloc.decref(pages)
    assert alloc.num_free == 1 and alloc.refcount(pages[0]) == 1
    alloc.decref(pages[:1])
    assert alloc.num_free == 2


def test_double_free_asserts():
    alloc = PageAllocator(3)
    pages = alloc.alloc(2)
    alloc.decref(pages)
    with pytest.raises(AssertionError, match="double free"):
        alloc.decref(pages[:1])
    with pytest.raises(AssertionError):
        alloc.incref(pages[:1])
    assert alloc.num_free == 3


# ---------------------------------------------------------------- slots_of


def test_slots_of_page_size_one():
    assert slots_of([5, 2, 9], 3, 1) == [5, 2, 9]
    assert slots_of([5, 2, 9], 2, 1) == [5, 2]
    assert slots_of([5, 2, 9], 0, 1) == []


def test_slots_of_page_size_four():
    assert slots_of([3, 1], 6, 4) == [12, 13, 14, 15, 4, 5]
    assert slots_of([3, 1], 8, 4) == [12, 13, 14, 15, 4, 5, 6, 7]
    assert slots_of([7], 1, 4) == [28]
    assert slots_of([], 0, 4) == []


@settings(max_examples=100, deadline=None)
@given(page_size=st.integers(1, 8), data=st.data())
def test_slots_of_matches_page_formula(page_size, data):
    num_pages = 16
    pages = data.draw(st.lists(st.integers(0, num_pages - 1), unique=True, max_size=num_pages))
    n = data.draw(st.integers(0, len(pages) * page_size))
    slots = slots_of(pages, n, page_size)
    assert len(slots) == n
    assert len(set(slots)) == n
    for i, s in enumerate(slots):
        assert s // page_size == pages[i // page_size]
        assert s % page_size == i % page_size
        assert 0 <= s < num_pages * page_size


# ---------------------------------------------------------------- KVPool buffers


def test_layout_bytes_per_token():
    assert KVLayout(2, (2, 4), (2, 3), 3).bytes_per_token(torch.float32) == (8 + 6) * 2 * 4
    assert KVLayout(3, (1, 6), None, 4).bytes_per_token(torch.bfloat16) == 6 * 3 * 2
    assert KVLayout(3, (1, 9), None, 2, layer_dims=(2, 9, 5)).bytes_per_token(torch.float32) == (2 + 9 + 5) * 4


def test_per_layer_widths_pool_and_copy():
    layout = KVLayout(2, (1, 5), None, 2, layer_dims=(2, 5))
    pool = KVPool(layout, num_pages=4, page_size=1, dtype=torch.float32, device=CPU)
    assert [tuple(k.shape) for k in pool.k] == [(4, 1, 2), (4, 1, 5)]
    assert [tuple(v.shape) for v in pool.v] == [(4, 1, 2), (4, 1, 2)]
    for k in pool.k:
        k[1] = torch.randn(k.shape[1:])
    pool.copy_slots([1], [3])
    assert all(torch.equal(k[3], k[1]) for k in pool.k)


def test_token_layer_rows_are_the_slots_of_the_extra_layer():
    layout = KVLayout(2, (1, 5), None, 2, layer_dims=(2, 5)).with_token_layer(7, lookback=3)
    assert (layout.num_layers, layout.layer_dims, layout.k_shape) == (3, (2, 5, 7), (1, 7))
    assert KVLayout(2, (2, 4), (2, 4), 4).with_token_layer(3, 1).layer_dims == (4, 4, 3)
    pool = KVPool(layout, num_pages=4, page_size=2, dtype=torch.float32, device=CPU)
    buf, rows = pool.token_rows(2, torch.tensor([5, 1]))
    assert buf.shape == (8, 7) and rows.tolist() == [5, 1]
    buf[rows] = torch.tensor([[1.0] * 7, [2.0] * 7])
    assert pool.k[2][5, 0].tolist() == [1.0] * 7 and pool.k[2][1, 0].tolist() == [2.0] * 7  # the pool's own rows
    _, rows = pool.token_rows(2, torch.tensor([[3, 6]]), torch.tensor([[True, False]]))
    assert rows.tolist() == [[3, 0]]  # padding reads row 0


def test_gqa_pool_shapes_and_write():
    layout = KVLayout(2, (2, 4), (2, 3), 3)
    pool = KVPool(layout, num_pages=3, page_size=2, dtype=torch.float32, device=CPU)
    assert pool.num_slots == 6 and pool.allocator.num_pages == 3
    assert [tuple(t.shape) for t in pool.k] == [(6, 2, 4)] * 2
    assert [tuple(t.shape) for t in pool.v] == [(6, 2, 3)] * 2
    slots = torch.tensor([4, 1])
    k = torch.arange(16, dtype=torch.float32).view(2, 2, 4) + 1
    v = -torch.arange(12, dtype=torch.float32).view(2, 2, 3) - 1
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], v)
    others = [0, 2, 3, 5]
    assert not pool.k[1][others].any() and not pool.v[1][others].any()
    assert not pool.k[0].any() and not pool.v[0].any()  # other layer untouched


def test_gqa_write_without_v_leaves_v():
    pool = KVPool(KVLayout(1, (1, 2), (1, 2), 2), 2, 1, torch.float32, CPU)
    pool.write(0, torch.tensor([1]), torch.ones(1, 1, 2), None)
    assert pool.k[0][1].sum() == 2 and not pool.v[0].any()


def test_gqa_copy_slots_all_layers():
    layout = KVLayout(3, (2, 4), (2, 4), 4)
    pool = KVPool(layout, 4, 4, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    for layer in range(3):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=g))
        pool.v[layer].copy_(torch.randn(pool.v[layer].shape, generator=g))
    before_k = [t.clone() for t in pool.k]
    before_v = [t.clone() for t in pool.v]
    src, dst = [4, 5, 6], [12, 13, 14]
    pool.copy_slots(src, dst)
    for layer in range(3):
        assert torch.equal(pool.k[layer][dst], before_k[layer][src])
        assert torch.equal(pool.v[layer][dst], before_v[layer][src])
        untouched = [s for s in range(16) if s not in dst]
        assert torch.equal(pool.k[layer][untouched], before_k[layer][untouched])
        assert torch.equal(pool.v[layer][untouched], before_v[layer][untouched])
    snapshot = [t.clone() for t in pool.k]
    pool.copy_slots([], [])  # no-op
    assert all(torch.equal(a, b) for a, b in zip(pool.k, snapshot))


def test_mla_v_is_a_view_of_k_latent_columns():
    layout = KVLayout(2, (1, 6), None, 4)  # [latent (4) | rope key (2)]
    pool = KVPool(layout, 4, 2, torch.float32, CPU)
    for layer in range(2):
        assert tuple(pool.v[layer].shape) == (8, 1, 4)
        assert pool.v[layer].data_ptr() == pool.k[layer].data_ptr()
    slots = torch.tensor([3, 6])
    k = torch.arange(12, dtype=torch.float32).view(2, 1, 6) + 1
    pool.write(0, slots, k, None)
    assert torch.equal(pool.k[0][slots], k)
    assert torch.equal(pool.v[0][slots], k[..., :4]), "writing k must update the V view"
    assert not pool.k[1].any()


def test_mla_write_with_v_writes_through_to_k():
    pool = KVPool(KVLayout(1, (1, 6), None, 4), 2, 2, torch.float32, CPU)
    slots = torch.tensor([2])
    pool.write(0, slots, torch.ones(1, 1, 6), torch.full((1, 1, 4), 7.0))
    assert pool.k[0][2].tolist() == [[7.0, 7.0, 7.0, 7.0, 1.0, 1.0]]


def test_mla_copy_slots_keeps_view_consistent():
    pool = KVPool(KVLayout(2, (1, 6), None, 4), 4, 4, torch.float32, CPU)
    g = torch.Generator().manual_seed(1)
    for layer in range(2):
        pool.k[layer].copy_(torch.randn(pool.k[layer].shape, generator=g))
    before = [t.clone() for t in pool.k]
    src, dst = [0, 1], [9, 10]
    pool.copy_slots(src, dst)
    for layer in range(2):
        assert torch.equal(pool.k[layer][dst], before[layer][src])
        assert torch.equal(pool.v[layer][dst], before[layer][src][..., :4])
        assert pool.v[layer].data_ptr() == pool.k[layer].data_ptr()
        assert torch.equal(pool.v[layer], pool.k[layer][..., :4])


# ---- num_kv_pages: the one KV budget rule (engine and EP workers) ----
_LAYOUT = KVLayout(num_layers=2, k_shape=(1, 256), v_shape=None, v_dim=192)  # 2 KiB per token in fp32


def test_num_kv_pages_explicit_tokens():
    assert num_kv_pages(_LAYOUT, torch.float32, CPU, 4, 1003, max_num_seqs=1, max_position=8) == 250
    with pytest.raises(ValueError, match="kv_cache_tokens must be >= page_size"):
        num_kv_pages(_LAYOUT, torch.float32, CPU, 16, 15, max_num_seqs=8, max_position=512)


def test_num_kv_pages_cpu_budget_split_between_ranks_and_capped(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KV_CACHE_MAX_CPU_GIB", str(2**-10))  # 1 MiB: 512 tokens, far below 1/4 of RAM
    one = num_kv_pages(_LAYOUT, torch.float32, CPU, 4, None, max_num_seqs=64, max_position=512)
    assert one == 512 // 4
    assert num_kv_pages(_LAYOUT, torch.float32, CPU, 4, None, 64, 512, num_sharing_ranks=2) == one // 2
    assert num_kv_pages(_LAYOUT, torch.bfloat16, CPU, 4, None, 64, 512) == 2 * one
    # Never more than every running request at full context: 2 x 100 tokens.
    assert num_kv_pages(_LAYOUT, torch.float32, CPU, 4, None, max_num_seqs=2, max_position=100) == 50
    # At least one page, however small the budget.
    monkeypatch.setenv("DEEPINFER_KV_CACHE_MAX_CPU_GIB", "0")
    assert num_kv_pages(_LAYOUT, torch.float32, CPU, 4, None, 64, 512) == 1


# ---- FP8 KV (kv_cache_dtype='fp8_e4m3') ----
from deepinfer_rt.cache.kv_pool import FP8_MAX, quantize_fp8_rows  # noqa: E402

GQA = KVLayout(2, (2, 8), (2, 8), 8, is_fp8_supported=True)
MLA = KVLayout(3, (1, 40), None, 32, is_fp8_supported=True)


def test_fp8_bytes_per_token_count_the_scales():
    assert GQA.bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 8 * 2
    assert GQA.bytes_per_token(torch.bfloat16, "fp8_e4m3") == 2 * 2 * 2 * (8 + 4)  # K and V rows, one scale each
    assert MLA.bytes_per_token(torch.bfloat16, "fp8_e4m3") == 3 * (40 + 4)  # V is K's prefix: no scale of its own
    mla_576 = KVLayout(61, (1, 576), None, 512, is_fp8_supported=True)
    ratio = mla_576.bytes_per_token(torch.bfloat16) / mla_576.bytes_per_token(torch.bfloat16, "fp8_e4m3")
    assert 1.98 < ratio < 2.0
    tokens = {d: num_kv_pages(mla_576, torch.bfloat16, CPU, 1, None, 1 << 20, 1 << 20, kv_cache_dtype=d)
              for d in ("auto", "fp8_e4m3")}
    assert 1.97 < tokens["fp8_e4m3"] / tokens["auto"] < 2.0  # the same memory holds about twice the tokens


def test_fp8_kv_cache_dtype_refused_where_unsupported():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        KVPool(GQA, 4, 1, torch.float32, CPU, "fp8")
    with pytest.raises(ValueError, match="not supported by this model's KV layout"):
        KVPool(KVLayout(2, (1, 40), None, 32, layer_dims=(40, 24)), 4, 1, torch.float32, CPU, "fp8_e4m3")


@pytest.mark.parametrize("layout", [GQA, MLA], ids=["gqa", "mla"])
def test_fp8_pool_write_read_copy(layout):
    g = torch.Generator().manual_seed(0)
    pool = KVPool(layout, 6, 2, torch.float32, CPU, "fp8_e4m3")
    assert pool.k[0].dtype == torch.float8_e4m3fn and pool.k_scale[0].shape == (12, layout.k_shape[0])
    assert (pool.v_scale is pool.k_scale) == (layout.v_shape is None)
    slots = torch.tensor([7, 2, 11, 4])
    k = torch.randn(4, *layout.k_shape, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 0.0])[:, None, None]
    v = None if layout.v_shape is None else torch.randn(4, *layout.v_shape, generator=g)
    pool.write(1, slots, k, v)
    rk, rv = pool.rows(1, slots)
    assert rk.dtype == torch.float32 and (rk[3] == 0).all()  # an all-zero row stays zero
    # e4m3 keeps 3 mantissa bits: each value within half a step (2^-4 relative) of its own magnitude's grid,
    # and the row's amax exactly (it maps to FP8_MAX)
    amax = k.abs().amax(-1, keepdim=True)
    assert ((rk - k).abs() <= k.abs() / 16 + amax / FP8_MAX * 2**-6 + 1e-30).all()
    torch.testing.assert_close(rk.abs().amax(-1), amax[..., 0], rtol=1e-6, atol=0)
    if v is None:
        assert torch.equal(rv, rk[..., : layout.v_dim])
    else:
        torch.testing.assert_close(rv, v, rtol=1 / 16, atol=v.abs().max().item() / FP8_MAX)
    q, s = quantize_fp8_rows(k)
    assert torch.equal(pool.k_scale[1][slots], s) and torch.equal(pool.k[1][slots].view(torch.uint8), q.view(torch.uint8))
    span_k, _ = pool.span(1, 2, 3)  # slots 2..4: a dequantized copy
    assert torch.equal(span_k[0], rk[1]) and torch.equal(span_k[2], rk[3])
    pool.copy_slots([7, 2], [0, 1])
    ck, cv = pool.rows(1, torch.tensor([0, 1]))
    assert torch.equal(ck, rk[:2]) and torch.equal(cv, rv[:2])
    assert (pool.k_scale[0] == 0).all()  # other layers untouched


def test_cpu_pool_starts_zero_and_layers_are_separate_memory():
    """The CPU pool's buffers are memory maps zeroed by the OS on first touch: zero, writable, one per layer."""
    pool = KVPool(KVLayout(3, (2, 4), (2, 4), 4), num_pages=64, page_size=16, dtype=torch.bfloat16, device=CPU)
    buffers = pool.k + pool.v
    assert all(b.shape == (1024, 2, 4) and b.dtype == torch.bfloat16 and b.is_contiguous() for b in buffers)
    assert all(not b.any() for b in buffers)
    pool.write(1, torch.tensor([0, 1023]), torch.ones(2, 2, 4), torch.full((2, 2, 4), 2.0))
    assert pool.k[1][[0, 1023]].eq(1).all() and pool.v[1][[0, 1023]].eq(2).all()
    assert int(pool.k[1].ne(0).sum()) == 16 and int(pool.v[1].ne(0).sum()) == 16
    assert all(not b.any() for i, b in enumerate(buffers) if i not in (1, 4))


def test_freed_pages_come_back_in_their_own_order():
    """A run of pages freed together is handed out again in the order it was held (ascending for a lone stream),
    so the next sequence's slots are consecutive and the CPU attention reads them as a view of the pool."""
    alloc = PageAllocator(16)
    first = [alloc.alloc(1)[0] for _ in range(6)]
    assert first == list(range(6))
    alloc.decref(first)
    again = [alloc.alloc(1)[0] for _ in range(6)]
    assert again == first
    alloc.decref(again[2:5])
    assert alloc.alloc(3) == again[2:5]
