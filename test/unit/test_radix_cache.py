"""RadixCache: matching, splitting, page alignment, locking, LRU eviction and flush, checked through the page ledger
of test/radix_helpers.py (which token prefix each page's KV was computed for); the stateful and soak tests are in
test_radix_cache_stateful.py."""
from __future__ import annotations

import pytest

from radix_helpers import finish, make_req, run_prompt, setup, tree_nodes, tree_pages


@pytest.mark.parametrize("page_size", [1, 4])
def test_match_reuses_inserted_pages_and_takes_references(page_size):
    allocator, cache, ledger = setup(32, page_size)
    first = make_req(range(12))
    assert cache.match(first) == ([], 0)
    assert ledger.compute(first, 12)
    cache.insert(first, 12)
    tree_owned = list(first.pages)

    second = make_req([*range(10), 99, 98])
    pages, num = cache.match(second)
    assert num == 10 // page_size * page_size
    assert pages == tree_owned[: num // page_size]
    ledger.check_match(second, pages, num)
    assert all(allocator.refcount(p) == 3 for p in pages)  # first, the tree, second
    assert second.cache_node is not None and second.num_locked_tokens == num
    assert cache.num_hit_tokens == num and cache.num_query_tokens == 12 + 12


@pytest.mark.parametrize("page_size, length, expected", [(1, 10, 9), (4, 8, 4), (4, 9, 8), (4, 3, 0)])
def test_match_leaves_at_least_one_token_to_compute(page_size, length, expected):
    _, cache, ledger = setup(16, page_size)
    run_prompt(cache, ledger, range(length))
    again = make_req(range(length))
    assert cache.peek(again) == expected
    assert cache.match(again)[1] == expected


def test_insert_rounds_down_to_whole_pages():
    allocator, cache, ledger = setup(16, 4)
    req = make_req(range(11))
    assert ledger.compute(req, 11)
    cache.insert(req, 11)
    assert cache.num_cached_pages == 2
    assert [path for _, path in tree_nodes(cache)] == [tuple(range(8))]
    assert req.num_locked_tokens == 8
    cache.insert(req, 3)  # less than a page beyond nothing: nothing changes
    assert cache.num_cached_pages == 2 and req.num_locked_tokens == 8


def test_match_inside_a_node_splits_it_and_keeps_pages():
    allocator, cache, ledger = setup(32, 2)
    run_prompt(cache, ledger, range(10))
    [(only, _)] = tree_nodes(cache)
    stored = list(only.pages)

    branch = make_req([0, 1, 2, 3, 7, 7, 7])
    pages, num = cache.match(branch)
    assert num == 4 and pages == stored[:2]
    paths = sorted(path for _, path in tree_nodes(cache))
    assert paths == [tuple(range(4)), tuple(range(10))]
    assert branch.cache_node.key == (0, 1, 2, 3) and branch.cache_node.lock_ref == 1
    lower = branch.cache_node.children[(4, 5)]
    assert lower.pages == stored[2:] and lower.lock_ref == 0 and lower.parent is branch.cache_node
    assert sorted(tree_pages(cache)) == sorted(stored)

    assert ledger.compute(branch, 7)
    finish(cache, allocator, branch)
    assert sorted(path for _, path in tree_nodes(cache)) == [(0, 1, 2, 3), tuple(range(10)), (0, 1, 2, 3, 7, 7)]


def test_peek_has_no_side_effects():
    allocator, cache, ledger = setup(32, 1)
    run_prompt(cache, ledger, range(10))
    refs = [allocator.refcount(p) for p in range(32)]
    counters = cache.stats()
    query = make_req([0, 1, 2, 3, 9])
    assert cache.peek(query) == 4
    assert len(tree_nodes(cache)) == 1 and query.cache_node is None
    assert [allocator.refcount(p) for p in range(32)] == refs
    assert cache.stats() == counters


def test_a_remembered_peek_follows_inserts_and_evictions_and_walks_nothing_meanwhile():
    """A waiting request is peeked every step (lpm order): the answer is remembered until the tree changes
    (a node added or removed), so repeated peeks compare no tokens; a split changes nothing it spells."""
    allocator, cache, ledger = setup(64, 1)
    run_prompt(cache, ledger, range(20))
    waiting = make_req(list(range(30)) + [99])
    assert cache.peek(waiting) == 20
    compared = cache.num_compared_tokens
    assert [cache.peek(waiting) for _ in range(5)] == [20] * 5 and cache.num_compared_tokens == compared
    run_prompt(cache, ledger, list(range(10)) + [7, 7])  # splits the node at 10 and adds a branch
    assert cache.peek(waiting) == 20
    run_prompt(cache, ledger, range(28))  # extends the path the waiting request follows
    assert cache.peek(waiting) == 28
    cache.evict(64)
    assert cache.peek(waiting) == 0


def test_chunked_inserts_are_idempotent_and_move_the_lock_down():
    allocator, cache, ledger = setup(32, 4)
    req = make_req(range(14))
    assert ledger.compute(req, 14)
    for done in (4, 8, 8, 12, 13):
        cache.insert(req, done)
        assert req.num_locked_tokens == done // 4 * 4
        locked = [node for node, _ in tree_nodes(cache) if node.lock_ref]
        assert sum(len(node.key) for node in locked) == req.num_locked_tokens  # exactly req's path is locked
    assert cache.num_cached_pages == 3
    assert all(allocator.refcount(p) == 2 for p in req.pages[:3]) and allocator.refcount(req.pages[3]) == 1
    cache.release(req)
    cache.release(req)  # idempotent
    assert all(node.lock_ref == 0 for node, _ in tree_nodes(cache)) and req.cache_node is None


def test_duplicate_pages_stay_with_the_request():
    allocator, cache, ledger = setup(16, 1)
    a, b = make_req(range(5)), make_req(range(5))
    for req in (a, b):  # both computed before either was inserted (admitted in the same step)
        assert ledger.compute(req, 5)
    a_pages, b_pages = list(a.pages), list(b.pages)
    finish(cache, allocator, a)
    cache.insert(b, 5)
    assert sorted(tree_pages(cache)) == sorted(a_pages)
    assert all(allocator.refcount(p) == 1 for p in b_pages)
    assert b.num_locked_tokens == 5
    finish(cache, allocator, b)
    assert allocator.num_free == 16 - 5


def test_locked_path_is_not_evicted():
    allocator, cache, ledger = setup(16, 1)
    run_prompt(cache, ledger, range(6))
    run_prompt(cache, ledger, [9, 9, 9])
    reader = make_req([*range(6), 5])
    pages, num = cache.match(reader)
    assert num == 6
    assert cache.evict(16) == 3  # only the unlocked [9, 9, 9]
    assert [path for _, path in tree_nodes(cache)] == [tuple(range(6))]
    assert cache.evict(1) == 0
    cache.release(reader)
    assert cache.evict(16) == 0  # reader still holds the pages: dropping the node frees nothing yet
    assert cache.num_cached_pages == 0
    allocator.decref(pages)
    assert allocator.num_free == 16


def test_eviction_is_least_recently_used_first():
    allocator, cache, ledger = setup(16, 1)
    for first in (1, 2, 3):
        run_prompt(cache, ledger, [first] * 3)
    reuse = make_req([1, 1, 1, 1])
    pages, _ = cache.match(reuse)  # touches [1, 1, 1]
    cache.release(reuse)
    allocator.decref(pages)
    order = []
    while cache.num_cached_pages:
        assert cache.evict(1) == 3
        order.append({path for _, path in tree_nodes(cache)})
    assert order == [{(1, 1, 1), (3, 3, 3)}, {(1, 1, 1)}, set()]
    assert cache.num_evicted_pages == 9 and allocator.num_free == 16


def test_evicting_a_leaf_exposes_its_parent():
    allocator, cache, ledger = setup(16, 1)
    run_prompt(cache, ledger, [1, 2, 3, 4])
    run_prompt(cache, ledger, [1, 2, 7, 7])  # splits into [1, 2] -> {[3, 4], [7, 7]}
    assert len(tree_nodes(cache)) == 3
    assert cache.evict(6) == 6
    assert tree_nodes(cache) == [] and allocator.num_free == 16


def test_flush_keeps_only_locked_paths():
    allocator, cache, ledger = setup(16, 1)
    run_prompt(cache, ledger, [1, 2, 3, 4])
    run_prompt(cache, ledger, [1, 2, 7, 7])
    run_prompt(cache, ledger, [5, 5])
    reader = make_req([1, 2, 3, 4, 0])
    pages, _ = cache.match(reader)
    cache.flush()
    assert sorted(path for _, path in tree_nodes(cache)) == [(1, 2), (1, 2, 3, 4)]
    assert cache.num_cached_pages == 4
    cache.release(reader)
    allocator.decref(pages)
    cache.flush()
    assert cache.num_cached_pages == 0 and allocator.num_free == 16
    assert cache.stats()["num_cached_pages"] == 0


# ---- random operation sequences, full accounting after every step ----
