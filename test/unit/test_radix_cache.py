"""RadixCache: matching, splitting, page alignment, locking, LRU eviction, flush, and page accounting.

Fake requests get real pages from a PageAllocator; `PageLedger` remembers which token prefix each page's KV was
computed for, so a match can be checked to hand back the KV of exactly the tokens it claims.
"""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 rule)

from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.cache.radix_cache import RadixCache, TreeNode
from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams

_rids = itertools.count()


def make_req(tokens) -> Req:
    return Req(next(_rids), list(tokens), SamplingParams(), seed=0)


class PageLedger:
    """What each page's KV was computed for: the token prefix ending at the page's last written slot (a
    position's KV depends on every token before it). Updated only by simulated forward passes."""

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.content: dict[int, tuple[int, ...]] = {}

    def pages_needed(self, req: Req, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) - len(req.pages)

    def compute(self, req: Req, num_tokens: int) -> bool:
        """Give req pages covering num_tokens and write the KV of its uncomputed positions below num_tokens;
        False (and nothing changes) when the pool is short."""
        need = self.pages_needed(req, num_tokens)
        if need > 0:
            pages = self.allocator.alloc(need)
            if pages is None:
                return False
            req.pages.extend(pages)
        ps = self.page_size
        for i in range(req.num_computed_tokens // ps, -(-num_tokens // ps)):
            self.content[req.pages[i]] = tuple(req.token_ids[: min((i + 1) * ps, num_tokens)])
        req.num_computed_tokens = max(req.num_computed_tokens, num_tokens)
        return True

    def check_match(self, req: Req, pages: list[int], num_tokens: int) -> None:
        assert num_tokens % self.page_size == 0 and num_tokens < req.num_tokens
        assert len(pages) * self.page_size == num_tokens
        for i, page in enumerate(pages):
            assert self.content[page] == tuple(req.token_ids[: (i + 1) * self.page_size]), \
                f"page {page} holds KV of other tokens"


def tree_nodes(cache: RadixCache) -> list[tuple[TreeNode, tuple[int, ...]]]:
    """(node, the token prefix its path spells) for every node below the root."""
    out, stack = [], [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            out.append((child, path + child.key))
            stack.append((child, path + child.key))
    return out


def tree_pages(cache: RadixCache) -> list[int]:
    return [p for node, _ in tree_nodes(cache) for p in node.pages]


def finish(cache: RadixCache, allocator: PageAllocator, req: Req) -> None:
    """The scheduler's order at finish: offer the computed tokens, unlock, then drop the request's pages."""
    cache.insert(req, req.num_computed_tokens)
    cache.release(req)
    allocator.decref(req.pages)
    req.pages = []


def run_prompt(cache: RadixCache, ledger: PageLedger, tokens) -> Req:
    """Admit, compute the whole prompt, and finish one request; returns it (its pages are released)."""
    req = make_req(tokens)
    req.pages, req.num_computed_tokens = cache.match(req)
    assert ledger.compute(req, req.num_tokens)
    finish(cache, ledger.allocator, req)
    return req


def setup(num_pages: int, page_size: int) -> tuple[PageAllocator, RadixCache, PageLedger]:
    allocator = PageAllocator(num_pages)
    return allocator, RadixCache(allocator, page_size), PageLedger(allocator, page_size)


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

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)
SUFFIX = st.lists(st.integers(0, 2), max_size=8)


class RadixCacheMachine(RuleBasedStateMachine):
    live = Bundle("live")

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def start(self, page_size):
        self.allocator = PageAllocator(24)
        self.cache = RadixCache(self.allocator, page_size)
        self.ledger = PageLedger(self.allocator, page_size)
        self.page_size = page_size
        self.requests: list[Req] = []
        self.history: list[list[int]] = []
        """Every sequence admitted so far; new ones often extend or branch off them, as prompts do."""
        self.waiting: list[Req] = []
        """Requests peeked (never admitted), peeked again later."""

    def _draw_tokens(self, data) -> list[int]:
        if not self.history or data.draw(st.booleans()):
            tokens = data.draw(TOKENS)
        else:
            base = data.draw(st.sampled_from(self.history))
            tokens = base[: data.draw(st.integers(0, len(base)))] + data.draw(SUFFIX)
        return tokens or [0]

    def _longest_cached(self, req: Req) -> int:
        """Reference for match: the longest whole-page prefix of req some node path spells (brute force)."""
        limit = (req.num_tokens - 1) // self.page_size * self.page_size
        best = 0
        for _, path in tree_nodes(self.cache):
            n = 0
            while n < min(len(path), limit) and path[n] == req.token_ids[n]:
                n += 1
            best = max(best, n // self.page_size * self.page_size)
        return best

    @rule(target=live, data=st.data(), fraction=st.floats(0, 1))
    def admit(self, data, fraction):
        req = make_req(self._draw_tokens(data))
        self.history.append(list(req.token_ids))
        expected = self._longest_cached(req)
        pages, num = self.cache.match(req)
        self.ledger.check_match(req, pages, num)
        assert num == expected, "match is not the longest cached prefix"
        req.pages, req.num_computed_tokens = pages, num
        if not self._compute(req, num + round(fraction * (req.num_tokens - num))):
            # Admission failed: the scheduler unlocks and gives the matched references back.
            self.cache.release(req)
            self.allocator.decref(req.pages)
            return multiple()
        self.requests.append(req)
        return req

    def _compute(self, req: Req, num_tokens: int) -> bool:
        """The scheduler's allocation: evict what is missing when the pool is short, then retry once."""
        if self.ledger.compute(req, num_tokens):
            return True
        missing = self.ledger.pages_needed(req, num_tokens) - self.allocator.num_free
        self._evict_and_check(missing)
        return self.ledger.compute(req, num_tokens)

    def _evict_and_check(self, num_pages: int) -> None:
        locked = {id(n) for n, _ in tree_nodes(self.cache) if n.lock_ref}
        free_before = self.allocator.num_free
        freed = self.cache.evict(num_pages)
        assert freed == self.allocator.num_free - free_before
        assert locked <= {id(n) for n, _ in tree_nodes(self.cache)}, "a locked node was evicted"
        if freed < num_pages:
            # It stopped early: no unlocked leaf may be left.
            assert all(n.children or n.lock_ref for n, _ in tree_nodes(self.cache))

    @rule(req=live, extra=st.integers(0, 6))
    def compute_and_insert(self, req, extra):
        self._compute(req, min(req.num_tokens, req.num_computed_tokens + extra))
        self.cache.insert(req, req.num_computed_tokens)
        assert req.num_locked_tokens == req.num_computed_tokens // self.page_size * self.page_size
        peeker = make_req(req.token_ids[: req.num_locked_tokens] + [0])
        assert self.cache.peek(peeker) == req.num_locked_tokens, "inserted prefix is not in the tree"

    @rule(req=live)
    def release(self, req):
        self.cache.release(req)

    @rule(req=consumes(live))
    def finish(self, req):
        finish(self.cache, self.allocator, req)
        self.requests.remove(req)

    @rule(data=st.data())
    def peek(self, data):
        req = make_req(self._draw_tokens(data))
        refs = [self.allocator.refcount(p) for p in range(self.allocator.num_pages)]
        shape = [(id(n), path) for n, path in tree_nodes(self.cache)]
        assert self.cache.peek(req) == self._longest_cached(req)
        assert [self.allocator.refcount(p) for p in range(self.allocator.num_pages)] == refs
        assert [(id(n), path) for n, path in tree_nodes(self.cache)] == shape
        self.waiting.append(req)

    @rule(data=st.data())
    def peek_again(self, data):
        """A waiting request is ordered every step: its remembered peek must follow every change of the tree."""
        if self.waiting:
            req = data.draw(st.sampled_from(self.waiting))
            assert self.cache.peek(req) == self._longest_cached(req)

    @rule(num_pages=st.integers(0, 24))
    def evict(self, num_pages):
        self._evict_and_check(num_pages)

    @rule()
    def flush(self):
        self.cache.flush()
        assert all(n.lock_ref for n, _ in tree_nodes(self.cache))

    @invariant()
    def pages_are_accounted_for(self):
        owned = tree_pages(self.cache)
        assert len(owned) == len(set(owned)), "the tree owns a page twice"
        assert self.cache.num_cached_pages == len(owned)
        owned_set = set(owned)
        for page in range(self.allocator.num_pages):
            holders = (page in owned_set) + sum(page in r.pages for r in self.requests)
            assert self.allocator.refcount(page) == holders, f"page {page}"
        assert self.allocator.num_free == sum(self.allocator.refcount(p) == 0
                                              for p in range(self.allocator.num_pages))

    @invariant()
    def tree_is_well_formed_and_locks_match_requests(self):
        ps = self.page_size
        locks: dict[int, int] = {}
        for req in self.requests:
            node = req.cache_node
            while node is not None and node is not self.cache.root:
                locks[id(node)] = locks.get(id(node), 0) + 1
                node = node.parent
        for node, path in tree_nodes(self.cache):
            assert node.key and len(node.key) % ps == 0 and len(node.pages) * ps == len(node.key)
            assert node.parent.children[node.key[:ps]] is node
            assert node.lock_ref == locks.get(id(node), 0)
            start = len(path) - len(node.key)
            for i, page in enumerate(node.pages):
                assert self.ledger.content[page] == path[: start + (i + 1) * ps]
        reachable = {id(n): path for n, path in tree_nodes(self.cache)}
        for req in self.requests:
            if req.cache_node is not None:
                assert reachable[id(req.cache_node)] == tuple(req.token_ids[: req.num_locked_tokens])

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for req in list(self.requests):
            finish(self.cache, self.allocator, req)
        self.cache.flush()
        assert self.allocator.num_free == self.allocator.num_pages


RadixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestRadixCacheMachine = RadixCacheMachine.TestCase


# ---- soak: the scheduler's sequence over thousands of requests ----

@pytest.mark.parametrize("page_size", [1, 4])
def test_soak_scheduler_sequence_leaks_nothing(page_size):
    rng = random.Random(page_size)
    num_pages = 256 // page_size
    allocator, cache, ledger = setup(num_pages, page_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 60))] for _ in range(12)]
    pending = []
    for _ in range(3000):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 61)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        pending.append((make_req(prompt), rng.randrange(0, 8)))
    running: list[tuple[Req, int]] = []
    num_retracted = 0

    def compute(req: Req, num_tokens: int) -> bool:
        missing = ledger.pages_needed(req, num_tokens) - allocator.num_free
        if missing > 0:
            cache.evict(missing)
        return ledger.compute(req, num_tokens)

    def drop(req: Req) -> None:
        finish(cache, allocator, req)
        req.num_computed_tokens = 0

    for step in itertools.count():
        if not (pending or running):
            break
        while pending and len(running) < 6:
            req, max_new = pending.pop()
            pages, num = cache.match(req)
            ledger.check_match(req, pages, num)
            req.pages, req.num_computed_tokens = pages, num
            running.append((req, max_new))
        req, max_new = running[rng.randrange(len(running))]
        chunk = min(req.num_tokens - req.num_computed_tokens, rng.randrange(1, 24))
        while not compute(req, req.num_computed_tokens + chunk):
            # Retract like the scheduler: the request with least progress gives its pages back, its computed
            # prefix stays cached, and it is admitted again next.
            victim = min((item for item in running if item[0] is not req), key=lambda it: it[0].num_computed_tokens)
            running.remove(victim)
            drop(victim[0])
            pending.append(victim)
            num_retracted += 1
        if req.num_computed_tokens < req.num_tokens:
            cache.insert(req, req.num_computed_tokens)
        elif req.num_output_tokens < max_new:
            req.token_ids.append(rng.randrange(50))  # sampled a token; its KV is computed in a later step
        else:
            running.remove((req, max_new))
            drop(req)
        if step % 64 == 0:
            held = set(tree_pages(cache)).union(*(r.pages for r, _ in running))
            assert allocator.num_free + len(held) == num_pages
    assert cache.num_hit_tokens > cache.num_query_tokens // 10  # shared prefixes were actually reused
    assert cache.num_evicted_pages > 0 and num_retracted > 0  # the small pool was actually under pressure
    assert all(node.lock_ref == 0 for node, _ in tree_nodes(cache))
    cache.flush()
    assert cache.num_cached_pages == 0 and allocator.num_free == num_pages
