"""RadixCache under random operation sequences (a hypothesis state machine) and a soak of the scheduler's sequence
over thousands of requests: page accounting and matches checked through test/radix_helpers.py's PageLedger."""
from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 rule)

from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.cache.radix_cache import RadixCache
from radix_helpers import PageLedger, finish, make_req, setup, tree_nodes, tree_pages


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
