"""Scheduler on CPU with no model: a fake engine loop drives schedule -> fake forward -> update -> fake sample.

The fake forward writes, for every computed position, K = [token id, position, 1, 0] into the pool, and checks
before each step that the KV a request already computed is still intact at its slots. That catches a page
handed to two requests, a page freed while still read, or a partly filled page shared instead of copied.
Tokens come from a deterministic function of (prompt, seed, position), so the final sequences must not
depend on batching, chunking or retraction.
"""
from __future__ import annotations

import pytest

from deepinfer_rt.request import Req, ReqStatus
from deepinfer_rt.sampling_params import SamplingParams
from scheduler_fakes import FakeEngine, expected_output, make_req, step_bound
def test_single_request_prefill_then_decode():
    eng = FakeEngine(num_pages=64)
    r = make_req(5, 3)
    eng.add(r)
    eng.run()
    assert [(s.items[0][1], s.items[0][2], s.items[0][3]) for s in eng.steps] == [(0, 5, True), (5, 1, True), (6, 1, True)]
    assert r.output_ids == expected_output(r, 3)
    assert r.finish_reason == "length" and r.num_retractions == 0


@pytest.mark.parametrize("budget", [1, 3, 8, 17])
def test_token_budget_respected_every_step(budget):
    eng = FakeEngine(num_pages=512, budget=budget)
    reqs = [make_req(p, o) for p, o in [(10, 5), (3, 7), (25, 2), (1, 4)]]
    eng.add(*reqs)
    eng.run(step_bound(reqs))
    assert all(sum(n for _, _, n, _ in s.items) <= budget for s in eng.steps)
    assert any(sum(n for _, _, n, _ in s.items) == budget for s in eng.steps)  # the budget is actually used
    for r in reqs:
        assert r.output_ids == expected_output(r, r.params.max_new_tokens)


def test_decodes_scheduled_before_new_prefill():
    eng = FakeEngine(num_pages=256, budget=5)
    a, b = make_req(2, 10), make_req(2, 10)
    eng.add(a, b)
    eng.step()  # both prompts (2 + 2 tokens)
    c = make_req(20, 2)
    eng.add(c)
    step = eng.step()
    assert [(r, n) for r, _, n, _ in step.items] == [(a, 1), (b, 1), (c, 3)]
    assert step.items[2][3] is False  # a partial prefill chunk does not sample
    step = eng.step()
    assert [(r, n) for r, _, n, _ in step.items] == [(a, 1), (b, 1), (c, 3)]
    assert c.num_computed_tokens == 6


def test_budget_exhausted_by_decodes_admits_nothing():
    eng = FakeEngine(num_pages=256, budget=2)
    a, b = make_req(1, 10), make_req(1, 10)
    eng.add(a, b)
    eng.step()
    c = make_req(3, 1)
    eng.add(c)
    step = eng.step()
    assert [r for r, *_ in step.items] == [a, b]
    assert c.status is ReqStatus.WAITING and c.pages == []


def test_chunked_prefill_splits_prompt_and_only_last_chunk_samples():
    eng = FakeEngine(num_pages=64, page_size=4, budget=4)
    r = make_req(10, 3)
    eng.add(r)
    eng.run()
    assert [s.items[0][1:] for s in eng.steps] == [
        (0, 4, False), (4, 4, False), (8, 2, True), (10, 1, True), (11, 1, True)]
    assert r.output_ids == expected_output(r, 3)


def test_chunked_prefill_interleaves_with_other_prefills_and_decodes():
    eng = FakeEngine(num_pages=64, budget=6)
    reqs = [make_req(13, 4), make_req(9, 4), make_req(2, 4)]
    eng.add(*reqs)
    eng.run(step_bound(reqs))
    for r in reqs:
        chunks = [(start, n, s) for step in eng.steps for (q, start, n, s) in step.items if q is r]
        # contiguous chunks, sampling exactly when the request catches up
        pos = 0
        for start, n, s in chunks:
            assert start == pos
            pos += n
        assert sum(s for _, _, s in chunks) == 4
        assert r.output_ids == expected_output(r, 4)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3])
def test_max_num_seqs_caps_running(max_num_seqs):
    eng = FakeEngine(num_pages=512, max_num_seqs=max_num_seqs)
    reqs = [make_req(4, 3 + i) for i in range(6)]
    eng.add(*reqs)
    eng.run(step_bound(reqs))
    assert max(len(s.items) for s in eng.steps) == max_num_seqs
    assert max(s.running_after for s in eng.steps) <= max_num_seqs
    for r in reqs:
        assert r.output_ids == expected_output(r, r.params.max_new_tokens)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_fcfs_admission_and_completion_order(policy):
    eng = FakeEngine(num_pages=512, max_num_seqs=1, policy=policy)
    reqs = [make_req(3 + (i * 5) % 7, 2 + i % 3) for i in range(5)]
    eng.add(*reqs)
    eng.run(step_bound(reqs))
    assert eng.admission_order == reqs
    assert eng.finished == reqs


def test_fcfs_head_of_line_is_not_overtaken_when_pool_is_short():
    # a0 holds most of the pool; a1 at the head of the queue cannot fit, so a2 (small) must wait behind it.
    eng = FakeEngine(num_pages=10)
    a0, a1, a2 = make_req(7, 2), make_req(5, 1), make_req(1, 1)
    eng.add(a0, a1, a2)
    eng.run(step_bound([a0, a1, a2]))
    assert eng.admission_order == [a0, a1, a2]


# ---------------------------------------------------------------- retraction


def _run_workload(num_pages: int, page_size: int, specs, budget: int = 16, max_num_seqs: int = 256):
    eng = FakeEngine(num_pages=num_pages, page_size=page_size, budget=budget, max_num_seqs=max_num_seqs)
    reqs = []
    for i, (p, o) in enumerate(specs):
        reqs.append(Req(i, [(7 * i + j) % 101 for j in range(p)], SamplingParams(max_new_tokens=o), seed=i))
    eng.add(*reqs)
    steps = eng.run(step_bound(reqs))
    return eng, reqs, steps


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_retraction_under_pressure_gives_same_tokens_as_big_pool(page_size):
    specs = [(6, 12), (9, 10), (4, 14), (7, 9), (5, 11)]
    big, big_reqs, _ = _run_workload(1024, page_size, specs)
    assert big.sched.num_retractions == 0
    small, small_reqs, _ = _run_workload(32 // page_size, page_size, specs)
    assert small.sched.num_retractions > 0
    assert any(r.num_retractions > 0 for r in small_reqs)
    assert any(s.retracted for s in small.steps)
    for a, b in zip(big_reqs, small_reqs):
        assert b.finish_reason == "length"
        assert b.output_ids == a.output_ids == expected_output(a, a.params.max_new_tokens)
    assert small.pool.allocator.num_free == small.num_pages


def test_retracted_request_recomputes_from_scratch():
    eng = FakeEngine(num_pages=12, budget=64)
    a, b = make_req(4, 8), make_req(4, 8)
    eng.add(a, b)
    eng.run(step_bound([a, b]))
    victims = [r for r in (a, b) if r.num_retractions]
    assert victims
    for v in victims:
        restarts = [start for s in eng.steps for (q, start, _, _) in s.items if q is v and start == 0]
        assert len(restarts) == v.num_retractions + 1
    assert a.output_ids == expected_output(a, 8) and b.output_ids == expected_output(b, 8)


def test_victim_is_the_request_with_fewest_outputs():
    eng = FakeEngine(num_pages=10, budget=64)
    old = make_req(3, 6)
    eng.add(old)
    for _ in range(3):
        eng.step()  # old: 3 outputs, 5 pages
    young = make_req(4, 6)
    eng.add(young)
    eng.step()  # old decodes (6 pages) and young prefills its 4-token prompt: 10 pages
    assert eng.pool.allocator.num_free == 0
    assert (old.num_output_tokens, young.num_output_tokens) == (4, 1)
    step = eng.step()  # old needs a page: the request with fewer outputs (young) is retracted
    assert young in step.retracted and old not in step.retracted
    eng.run(step_bound([old, young]))
    assert old.num_retractions == 0


def test_victim_is_chosen_among_several_by_fewest_outputs():
    # old grows and the pool is full; mid (2 outputs) and young (1 output) are both candidates: young goes.
    eng = FakeEngine(num_pages=17, budget=64, decode_reserve_tokens=0)
    old, mid, young = make_req(3, 12), make_req(3, 12), make_req(4, 12)
    eng.add(old)
    for _ in range(3):
        eng.step()
    eng.add(mid)
    eng.step()
    eng.step()
    eng.add(young)
    eng.step()
    assert [r.num_output_tokens for r in (old, mid, young)] == [6, 3, 1]
    assert eng.pool.allocator.num_free == 0  # 8 + 5 + 4 computed tokens, one page each
    step = eng.step()
    assert step.retracted == [young], [r.rid for r in step.retracted]
    eng.run(step_bound([old, mid, young]))
    assert old.num_retractions == 0
    for r in (old, mid, young):
        assert r.output_ids == expected_output(r, 12)


# ---------------------------------------------------------------- requests larger than the pool


def test_prompt_larger_than_pool_finishes_with_error():
    eng = FakeEngine(num_pages=8, budget=4)
    r = make_req(20, 4)
    eng.add(r)
    eng.run(50)
    assert r.finish_reason == "error" and r.error
    assert r.output_ids == []


def test_output_outgrowing_pool_finishes_with_length():
    eng = FakeEngine(num_pages=8, page_size=2, budget=64)
    r = make_req(10, 20)
    eng.add(r)
    eng.run(50)
    assert r.finish_reason == "length"
    assert 1 <= r.num_output_tokens < 20
    # the last token sampled needs no KV: up to pool size - prompt + 1 outputs
    assert r.num_output_tokens == 16 - 10 + 1
    assert r.output_ids == expected_output(r, r.num_output_tokens)


def test_too_large_request_does_not_block_others():
    eng = FakeEngine(num_pages=16, budget=8)
    big, small = make_req(40, 2), make_req(3, 3)
    eng.add(big, small)
    eng.run(100)
    assert big.finish_reason == "error"
    assert small.finish_reason == "length" and small.output_ids == expected_output(small, 3)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompt_larger_than_pool_and_budget_larger_than_pool_does_not_hang(page_size):
    # The default budget (2048 tokens) is larger than a small pool (kv_cache_tokens=64, say). A prompt that
    # does not fit must still end with an error instead of waiting forever at the head of the queue.
    eng = FakeEngine(num_pages=16 // page_size, page_size=page_size, budget=2048)
    r = make_req(40, 4)
    after = make_req(3, 2)
    eng.add(r, after)
    eng.run(100)
    assert r.finish_reason in ("error", "length")
    assert after.output_ids == expected_output(after, 2)


# ---------------------------------------------------------------- n > 1: followers share the leader's prompt


def test_waiting_prompts_are_not_matched_again_while_the_tree_is_unchanged():
    """lpm orders the waiting queue by cached prefix every step. With the running slots full and 40 waiting
    2K-token prompts (half share a cached 1.5K prefix), steady decode steps compare no prompt tokens against the
    tree: each peek is remembered until the tree changes. The order stays the cached-prefix order."""
    from deepinfer_rt.cache.radix_cache import RadixCache
    from deepinfer_rt.scheduler.policy import order_waiting

    eng = FakeEngine(num_pages=8192, max_num_seqs=2, policy="lpm", budget=4096)
    eng.cache = eng.sched.cache = RadixCache(eng.pool.allocator, eng.page_size)
    eng.check_ownership = lambda: None  # the tree holds page references too
    shared = [(i * 7 + 3) % 997 for i in range(1536)]
    warm = make_req(0, 1, prompt=shared + [5])
    eng.add(warm)
    while eng.sched.has_work:
        eng.step()
    running = [make_req(8, 60) for _ in range(2)]
    eng.add(*running)
    eng.step()  # both admitted: the slots are full from here on
    waiting = [make_req(0, 4, prompt=(shared if i % 3 == 0 else []) + [(i * 13 + j) % 991 for j in range(512)])
               for i in range(40)]
    eng.add(*waiting)
    per_step = []
    for _ in range(6):
        before = eng.cache.num_compared_tokens
        eng.step()
        per_step.append(eng.cache.num_compared_tokens - before)
        assert all(r in eng.sched.waiting for r in waiting)
    assert per_step[0] >= 14 * 1536 and per_step[1:] == [0] * 5, per_step

    def fresh(r):
        return eng.cache._walk(r.token_ids, (r.num_tokens - 1) // eng.page_size * eng.page_size, eng.cache.root, 0,
                               split=False)[1]

    ordered = order_waiting(list(eng.sched.waiting), "lpm", eng.cache, 10**6)
    assert ordered == sorted(eng.sched.waiting, key=lambda r: -fresh(r))
    assert [fresh(r) for r in ordered[:14]] == [1536] * 14


def test_a_prompt_sharing_an_inflight_prefill_waits_for_it_and_hits_the_cache():
    """Two prompts sharing 200 tokens, prefilled in 128-token chunks: the second, checked where the first's last
    chunk leaves budget, waits for it, then starts from the cache (its remembered peek gave way to the first's
    chunk inserts). The last prompt chunk is offered to the cache only at finish, so the hit is the first chunk."""
    from deepinfer_rt.cache.radix_cache import RadixCache

    eng = FakeEngine(num_pages=1024, policy="lpm", budget=128)
    eng.cache = eng.sched.cache = RadixCache(eng.pool.allocator, eng.page_size)
    eng.check_ownership = lambda: None  # the tree holds page references too
    shared = [(i * 7 + 3) % 997 for i in range(200)]
    first, second = make_req(0, 2, prompt=shared + [1, 2]), make_req(0, 2, prompt=shared + [3, 4, 5])
    eng.add(first, second)
    eng.step()
    assert eng.sched.cache.peek(second) == 128
    eng.step()  # the first's last chunk; 54 tokens of budget left, but the second waits for the shared part
    assert second in eng.sched.waiting and first.num_computed_tokens == first.prompt_len
    while eng.sched.has_work:
        eng.step()
    assert second.num_cached_tokens == 128 and second.output_ids == expected_output(second, 2)
