"""The compact DeepSeek-V4 pool on its own (models/deepseek_v4/cache.py): recent pages follow a sequence and
stay at checkpoints, prefix hits are cut back to where recent state exists, freed pages take their state along."""
from __future__ import annotations

import pytest
import torch

from deepinfer_rt.cache.kv_pool import KVLayout, KVPool, slots_of
from deepinfer_rt.forward_batch import ForwardBatch
from deepinfer_rt.models.deepseek_v4.cache import V4KVLayout, V4Pool

PS, R, K = 4, 7, 16
LAYOUT = V4KVLayout(3, (1, 8), None, 8, layer_dims=(8, 24, 40), ratios=(0, 8, 4), entry_dims=(0, 8, 12),
                    recent_tokens=R, checkpoint_tokens=K, recent_fraction=1.0, release_margin=0)


def _step(pool: V4Pool, seqs: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
    """seqs: (pages, start, kv_len) per sequence -> the recent slots prepare gives."""
    kv_slots = [torch.tensor(slots_of(p, n, PS)) for p, _, n in seqs]
    q_lens = [n - s for _, s, n in seqs]
    ids = torch.zeros(sum(q_lens), dtype=torch.long)
    batch = ForwardBatch(ids, ids, ids, q_lens, [n for _, _, n in seqs], kv_slots, pool, None)
    return pool.prepare(batch)


def _run(pool: V4Pool, pages: list[int], prompt: int, total: int) -> None:
    _step(pool, [(pages, 0, prompt)])
    for n in range(prompt + 1, total + 1):
        _step(pool, [(pages, n - 1, n)])


def test_kv_pool_builds_the_compact_pool_and_checks_page_size():
    pool = KVPool(LAYOUT, 32, PS, torch.float32, torch.device("cpu"))
    assert isinstance(pool, V4Pool)
    # min(m, page_size) = 4; one padding row (fixed-shape decode steps write their padding rows there)
    assert [e.shape[0] for e in pool.entries] == [0, 32 * PS // 4 + 1, 32 * PS // 4 + 1]
    with pytest.raises(ValueError, match="page_size"):
        V4Pool(LAYOUT, 32, 3, torch.float32, torch.device("cpu"))


def test_compact_pool_has_the_generic_pool_attributes():
    fp8 = V4Pool(LAYOUT.with_kv_dtype("fp8_e4m3"), 8, PS, torch.bfloat16, torch.device("cpu"))
    plain = KVPool(KVLayout(1, (1, 8), None, 8), 8, PS, torch.bfloat16, torch.device("cpu"))
    for pool in (fp8, plain):
        assert (pool.page_size, pool.num_slots, pool.dtype) == (PS, 8 * PS, torch.bfloat16)
        assert pool.allocator.num_pages == 8 and pool.k_scale is None and pool.v_scale is None
    # Its FP8 rows are its own (read through LayerKV), not K/V heads the attention backends dequantize.
    assert (fp8.kv_cache_dtype, fp8.is_fp8, fp8.layout.is_fp8) == ("fp8_e4m3", False, True)
    assert fp8.allocator.prefix_guard is fp8


def test_recent_pages_follow_the_sequence_and_stay_at_checkpoints():
    pool = V4Pool(LAYOUT, 32, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(12)  # 48 positions
    _run(pool, pages, prompt=10, total=45)
    has = [pool.has_recent(p) for p in pages]
    # Kept: before the checkpoints 16 and 32 (positions 9..15, 25..31 -> pages 2-3, 6-7), and the last R
    # positions before the last step's start (44 - 7 = 37.. -> pages 9-11).
    assert has == [False, False, True, True, False, False, True, True, False, True, True, True]
    assert [pool.is_pinned(p) for p in pages[:8]] == [False, False, True, True, False, False, True, True]
    # Hits resume only where the R positions before them have recent state.
    assert pool.restorable(pages, 44) == 44
    assert pool.restorable(pages, 36) == 32
    assert pool.restorable(pages, 28) == 16
    assert pool.restorable(pages, 43) == 43  # not page-aligned (n > 1 siblings): [36, 43) is there
    assert pool.restorable(pages, 42) == 32  # [35, 42) is not (page 8 went)
    assert pool.restorable(pages, 3 * PS) == 0 and pool.restorable(pages, 0) == 0
    # Freeing the main pages frees their recent pages.
    used = pool.num_recent_in_use
    pool.allocator.decref(pages)
    assert used == sum(has) and pool.num_recent_in_use == 0


def test_a_hit_pins_its_resume_point_and_a_later_sequence_cannot_release_it():
    pool = V4Pool(LAYOUT, 64, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(12)
    _run(pool, pages, prompt=10, total=45)
    # A second sequence resumes at 44 over the first's pages and runs on: 40..43 stay for another hit.
    pool.allocator.incref(pages[:11])
    pool.keep(pages[:11], 44)
    mine = pages[:11] + pool.allocator.alloc(6)
    _step(pool, [(mine, 44, 48)])
    for n in range(49, 68):
        _step(pool, [(mine, n - 1, n)])
    assert pool.restorable(pages, 44) == 44
    assert not pool.has_recent(mine[12])  # its own page, passed and never pinned


def test_resuming_where_state_is_gone_is_an_error():
    pool = V4Pool(LAYOUT, 32, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(12)
    _run(pool, pages, prompt=10, total=45)
    with pytest.raises(RuntimeError, match="recent KV state"):
        _step(pool, [(pages, 24, 25)])


def test_recent_slots_map_through_the_page_indirection():
    pool = V4Pool(LAYOUT, 32, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(3)
    (recent,) = _step(pool, [(pages, 0, 10)])
    want = [pool._recent_of[pages[i // PS]] * PS + i % PS for i in range(10)]
    assert recent.tolist() == want and len(set(want)) == 10


def test_token_layer_lives_in_recent_rows_through_the_indirection():
    base = V4KVLayout(**{**LAYOUT.__dict__, "idx_entry_dims": (0, 0, 0)})
    layout = base.with_token_layer(6, lookback=9)
    assert isinstance(layout, V4KVLayout) and layout.layer_dims == (8, 24, 40, 6)
    assert (layout.ratios, layout.entry_dims, layout.idx_entry_dims) == ((0, 8, 4, 0), (0, 8, 12, 0), (0,) * 4)
    assert layout.recent_tokens == 9
    assert base.with_token_layer(6, lookback=2).recent_tokens == R  # never fewer than the model's own
    pool = V4Pool(layout, 32, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(3)
    (recent,) = _step(pool, [(pages, 0, 10)])
    slots = torch.tensor(slots_of(pages, 10, PS))
    buf, rows = pool.token_rows(3, slots)
    assert buf is pool.recent[3] and torch.equal(rows, recent)
    buf[rows] = torch.arange(10.0)[:, None].expand(10, 6)
    _, back = pool.token_rows(3, slots[torch.tensor([[7, 2]])], torch.tensor([[True, False]]))
    assert buf[back][..., 0].tolist() == [[7.0, buf[0, 0].item()]] and back[0, 1] == 0  # padding reads row 0
    pool.allocator.decref(pages)  # their recent state goes (on the device at the next step)
    _step(pool, [(pool.allocator.alloc(1), 0, 1)])
    with pytest.raises(RuntimeError, match="released"):
        pool.token_rows(3, slots)


def test_bytes_per_token_split():
    d = torch.float32
    assert LAYOUT.long_lived_bytes_per_token(d) == pytest.approx(4 * (8 / 8 + 12 / 4))
    assert LAYOUT.recent_bytes_per_token(d) == 4 * (8 + 24 + 40)
    assert LAYOUT.window_bytes_per_sequence(d) == R * 4 * 72


def test_a_long_prompt_releases_its_recent_pages_once_decoding_passes_them():
    layout = V4KVLayout(**{**LAYOUT.__dict__, "checkpoint_tokens": 1024})
    pool = V4Pool(layout, 64, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(60)
    _run(pool, pages, prompt=200, total=230)  # one 200-token step, far more than the fallback lookback
    # Kept: the last R positions (222.. -> pages 55-57) only.
    assert [p for p, page in enumerate(pages) if pool.has_recent(page)] == [55, 56, 57]


def test_a_short_recent_pool_reclaims_pins_then_refuses(monkeypatch):
    import deepinfer_rt.models.deepseek_v4.cache as cache

    monkeypatch.setattr(cache, "_MIN_RECENT_TOKENS", 0)
    layout = V4KVLayout(**{**LAYOUT.__dict__, "checkpoint_tokens": 8, "recent_fraction": 0.25})
    pool = V4Pool(layout, 48, PS, torch.float32, torch.device("cpu"))
    assert pool.num_recent_pages == 12
    a = pool.allocator.alloc(10)
    _run(pool, a, prompt=8, total=40)  # pins before 8, 16, 24, 32, 40 (the main pages stay held, as by the cache)
    assert pool.restorable(a, 32) == 32 and pool.num_recent_in_use == 10
    b = pool.allocator.alloc(3)
    _step(pool, [(b, 0, 12)])  # three pages, two free: a's pins go, oldest first, two at a time
    assert pool.num_recent_reclaimed == 2 and all(pool.has_recent(p) for p in b)
    assert pool.restorable(a, 8) == 0 and pool.restorable(a, 16) == 16
    c = pool.allocator.alloc(13)
    with pytest.raises(RuntimeError, match="DEEPINFER_V4_RECENT_FRACTION"):
        _step(pool, [(c, 0, 52)])  # 13 pages in one step: more than the whole recent pool


def test_release_margin_keeps_more_than_r():
    layout = V4KVLayout(**{**LAYOUT.__dict__, "release_margin": 8})
    pool = V4Pool(layout, 32, PS, torch.float32, torch.device("cpu"))
    pages = pool.allocator.alloc(12)
    _run(pool, pages, prompt=10, total=45)
    # Released: pages wholly before 44 - 7 - 8 = 29 (unpinned ones: 0, 1, 4, 5); 6.. stay.
    assert [pool.has_recent(p) for p in pages] == [False, False, True, True, False, False] + [True] * 6
