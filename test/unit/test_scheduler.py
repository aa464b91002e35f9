"""Scheduler on CPU with no model: a fake engine loop drives schedule -> fake forward -> update -> fake sample.

The fake forward writes, for every computed position, K = [token id, position, 1, 0] into the pool, and checks
before each step that the KV a request already computed is still intact at its slots. That catches a page
handed to two requests, a page freed while still read, or a partly filled page shared instead of copied.
Tokens come from a deterministic function of (prompt, seed, position), so the final sequences must not
depend on batching, chunking or retraction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_rt.cache.base import NoPrefixCache
from deepinfer_rt.cache.kv_pool import KVLayout, KVPool, slots_of
from deepinfer_rt.config import SchedulerConfig
from deepinfer_rt.request import Req, ReqStatus
from deepinfer_rt.sampling_params import SamplingParams
from deepinfer_rt.scheduler.scheduler import Scheduler

CPU = torch.device("cpu")
LAYOUT = KVLayout(1, (1, 4), (1, 4), 4)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fake_token(req: Req, position: int) -> int:
    return hash((tuple(req.prompt_ids), req.seed, position)) % 1000


def expected_output(req: Req, num_out: int) -> list[int]:
    return [fake_token(req, req.prompt_len + j) for j in range(num_out)]


_rids = iter(range(10**9))


def make_req(prompt_len: int, max_new: int, seed: int | None = None, prompt: list[int] | None = None) -> Req:
    rid = next(_rids)
    ids = prompt if prompt is not None else [(rid * 31 + i) % 997 for i in range(prompt_len)]
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new), rid if seed is None else seed)


def make_group(prompt_len: int, max_new: int, n: int) -> list[Req]:
    """n > 1: a leader and followers with the same prompt (as the engine builds them)."""
    leader = make_req(prompt_len, max_new)
    group = [leader]
    for k in range(1, n):
        f = make_req(prompt_len, max_new, prompt=list(leader.prompt_ids), seed=leader.seed * 10 + k)
        f.leader = leader
        group.append(f)
    return group


@dataclass
class Step:
    items: list[tuple[Req, int, int, bool]]
    """(req, start, num_new_tokens, samples)"""
    admitted: list[Req]
    retracted: list[Req]
    running_after: int


@dataclass
class FakeEngine:
    num_pages: int
    page_size: int = 1
    budget: int = 2048
    max_num_seqs: int = 256
    policy: str = "fcfs"
    decode_reserve_tokens: int = SchedulerConfig.decode_reserve_tokens
    steps: list[Step] = field(default_factory=list)
    finished: list[Req] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pool = KVPool(LAYOUT, self.num_pages, self.page_size, torch.float32, CPU)
        self.cache = NoPrefixCache(self.pool.allocator, self.page_size)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=self.max_num_seqs, chunked_prefill_tokens=self.budget,
                                               schedule_policy=self.policy,
                                               decode_reserve_tokens=self.decode_reserve_tokens),
                               self.pool, self.cache)
        self.reqs: list[Req] = []
        self.admission_order: list[Req] = []

    def add(self, *reqs: Req) -> None:
        for r in reqs:
            self.reqs.append(r)
            self.sched.add(r)

    # -- the fake model --
    def _kv(self, req: Req, positions: range) -> torch.Tensor:
        rows = [[float(req.token_ids[p]), float(p), 1.0, 0.0] for p in positions]
        return torch.tensor(rows, dtype=torch.float32).view(len(rows), 1, 4)

    def _check_kv(self, req: Req, upto: int) -> None:
        if upto == 0:
            return
        slots = torch.tensor(slots_of(req.pages, upto, self.page_size))
        got = self.pool.k[0][slots]
        assert torch.equal(got, self._kv(req, range(upto))), f"KV of request {req.rid} was overwritten or not copied"

    def _forward(self, req: Req, start: int, num_new: int) -> None:
        self._check_kv(req, start)
        slots = torch.tensor(slots_of(req.pages, start + num_new, self.page_size)[start:])
        kv = self._kv(req, range(start, start + num_new))
        self.pool.write(0, slots, kv, kv)

    def check_ownership(self) -> None:
        alloc = self.pool.allocator
        holders = [0] * alloc.num_pages
        for r in self.sched.running:
            assert r.status is ReqStatus.RUNNING
            held = r.pages + r.spare_pages
            assert len(set(held)) == len(held)
            for p in held:
                holders[p] += 1
        for r in self.sched.waiting:
            assert r.pages == [] and r.spare_pages == [] and r.num_computed_tokens == 0
            assert r.status is ReqStatus.WAITING
        for r in self.reqs:
            if r.is_finished:
                assert r.pages == [] and r.spare_pages == [], f"finished request {r.rid} still holds pages"
        assert [alloc.refcount(p) for p in range(alloc.num_pages)] == holders, "page refcounts != holders"
        assert alloc.num_free == holders.count(0)
        assert len(self.sched.running) <= self.max_num_seqs

    def step(self) -> Step:
        sched = self.sched
        was_running = {id(r) for r in sched.running}
        was_waiting = {id(r) for r in sched.waiting}
        retractions_before = {id(r): r.num_retractions for r in self.reqs}
        batch = sched.schedule()
        if batch.is_empty:
            assert not sched.has_work, "empty batch while requests remain: the engine would spin or raise"
        items = [(it.req, it.start, it.num_new_tokens, it.samples) for it in batch.items]
        # budget and ordering: requests running before the step (and not retracted) come before new admissions
        assert batch.num_tokens <= self.budget
        assert all(n >= 1 for _, _, n, _ in items)
        assert len({id(r) for r, *_ in items}) == len(items), "a request scheduled twice in one step"
        kinds = []
        for r, start, n, _ in items:
            assert r.status is ReqStatus.RUNNING and r in sched.running
            assert start + n <= r.num_tokens
            assert len(r.pages) == cdiv(start + n, self.page_size), "pages do not cover exactly the computed tokens"
            if id(r) in was_waiting:
                kinds.append("new")
            elif r.num_retractions == retractions_before[id(r)]:
                kinds.append("old")
        assert kinds == sorted(kinds, key=lambda k: k == "new"), "a new prefill was scheduled before a decode"
        admitted = [r for r, *_ in items if id(r) in was_waiting]
        self.admission_order += admitted
        if admitted:
            # running requests are served before admissions, so none of them may be left out
            scheduled = {id(r) for r, *_ in items}
            assert all(id(r) in scheduled for r in sched.running if id(r) in was_running)
        retracted = [r for r in self.reqs if r.num_retractions > retractions_before[id(r)]]
        for r, start, n, _ in items:
            self._forward(r, start, n)
        samplers = [it.req for it in batch.items if it.samples]  # before update: depends on computed count
        sched.update(batch)
        for r, start, n, s in items:
            assert r.num_computed_tokens == start + n
        for req in samplers:
            req.token_ids.append(fake_token(req, req.num_tokens))
            if req.num_output_tokens >= req.params.max_new_tokens:
                req.finish("length")
                sched.finish(req)
                self.finished.append(req)
        for r in list(sched.running):  # finished by the scheduler itself (too large for the pool)
            if r.is_finished:
                sched.finish(r)
        for r in self.reqs:
            if r.is_finished and r not in self.finished:
                self.finished.append(r)
        self.check_ownership()
        step = Step(items, admitted, retracted, len(sched.running))
        self.steps.append(step)
        return step

    def run(self, max_steps: int = 10_000) -> int:
        n = 0
        while self.sched.has_work:
            n += 1
            assert n <= max_steps, (f"no completion after {max_steps} steps: waiting="
                                    f"{[r.rid for r in self.sched.waiting]} running={[r.rid for r in self.sched.running]}")
            self.step()
        assert all(r.is_finished for r in self.reqs)
        assert self.pool.allocator.num_free == self.num_pages, "pages leaked"
        return n


def step_bound(reqs: list[Req]) -> int:
    return 10 * sum(r.prompt_len + r.params.max_new_tokens for r in reqs) + 20


# ---------------------------------------------------------------- basics


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


@pytest.mark.parametrize("page_size, prompt_len", [(1, 10), (4, 10), (4, 9), (4, 5), (2, 7), (4, 2)])
def test_followers_share_leader_prompt_pages(page_size, prompt_len):
    eng = FakeEngine(num_pages=128 // page_size, page_size=page_size)
    group = make_group(prompt_len, 4, 3)
    leader, followers = group[0], group[1:]
    eng.add(*group)
    step = eng.step()
    assert [r for r, *_ in step.items] == [leader]  # followers wait for the shared prompt
    assert all(f.status is ReqStatus.WAITING and f.pages == [] for f in followers)

    batch = eng.sched.schedule()  # inspect admission state before update
    by_req = {id(it.req): it for it in batch.items}
    num_shared = prompt_len - 1
    num_full, rem = divmod(num_shared, page_size)
    for f in followers:
        it = by_req[id(f)]
        assert f.num_computed_tokens == num_shared == it.start
        assert it.num_new_tokens == 1 and it.samples
        assert f.num_cached_tokens == num_shared
        assert f.pages[:num_full] == leader.pages[:num_full]
        assert len(f.pages) == cdiv(prompt_len, page_size)
        for p in f.pages[num_full:]:
            assert p not in leader.pages and eng.pool.allocator.refcount(p) == 1
    for p in leader.pages[:num_full]:
        assert eng.pool.allocator.refcount(p) == 3
    if rem:
        tails = {f.pages[num_full] for f in followers}
        assert len(tails) == len(followers), "the partly filled page must be copied, one per follower"
    for f in followers:
        eng._check_kv(f, num_shared)  # shared + copied KV equals the leader's prompt KV
    # hand the inspected batch back through the fake engine's model step
    _finish_step(eng, batch)
    eng.run(100)
    for r in group:
        assert r.finish_reason == "length" and r.output_ids == expected_output(r, 4)
    assert len({tuple(r.output_ids) for r in group}) == 3


@pytest.mark.parametrize("page_size", [1, 4])
def test_followers_of_one_token_prompt_start_at_once(page_size):
    # nothing to share (prompt_len - 1 == 0): every sibling computes its single prompt token itself
    eng = FakeEngine(num_pages=64 // page_size, page_size=page_size)
    group = make_group(1, 3, 3)
    eng.add(*group)
    step = eng.step()
    assert [(r, start, n) for r, start, n, _ in step.items] == [(r, 0, 1) for r in group]
    assert len({p for r in group for p in r.pages}) == 3
    eng.run(100)
    for r in group:
        assert r.output_ids == expected_output(r, 3)


def _finish_step(eng: FakeEngine, batch) -> None:
    items = [(it.req, it.start, it.num_new_tokens) for it in batch.items]
    samplers = [it.req for it in batch.items if it.samples]
    for r, start, n in items:
        eng._forward(r, start, n)
    eng.sched.update(batch)
    for req in samplers:
        req.token_ids.append(fake_token(req, req.num_tokens))
        if req.num_output_tokens >= req.params.max_new_tokens:
            req.finish("length")
            eng.sched.finish(req)
    eng.check_ownership()


@pytest.mark.parametrize("page_size", [1, 4])
def test_followers_wait_for_chunked_leader_prompt(page_size):
    eng = FakeEngine(num_pages=128 // page_size, page_size=page_size, budget=4)
    group = make_group(11, 3, 2)
    leader, follower = group
    eng.add(*group)
    while follower.status is ReqStatus.WAITING:
        step = eng.step()
        assert follower not in step.admitted or leader.num_computed_tokens >= 10
    # admitted only once the leader computed prompt_len - 1 tokens; it computed just its last prompt token
    first = [(start, n) for s in eng.steps for (q, start, n, _) in s.items if q is follower][0]
    assert first == (10, 1)
    eng.run(100)
    assert follower.output_ids == expected_output(follower, 3)
    assert leader.output_ids == expected_output(leader, 3)


def test_follower_after_leader_finished_computes_prompt_itself():
    eng = FakeEngine(num_pages=64, max_num_seqs=1)
    leader, follower = make_group(6, 2, 2)
    eng.add(leader, follower)
    eng.run(100)
    first = [(start, n) for s in eng.steps for (q, start, n, _) in s.items if q is follower][0]
    assert first == (0, 6)
    assert follower.output_ids == expected_output(follower, 2)


def test_followers_under_pool_pressure_all_finish():
    eng = FakeEngine(num_pages=14, page_size=2, budget=8)
    groups = [make_group(6, 5, 3), make_group(3, 6, 2)]
    reqs = [r for g in groups for r in g]
    eng.add(*reqs)
    eng.run(step_bound(reqs))
    for r in reqs:
        assert r.finish_reason == "length" and r.output_ids == expected_output(r, r.params.max_new_tokens)


# ---------------------------------------------------------------- random workloads


@st.composite
def workloads(draw):
    page_size = draw(st.sampled_from([1, 2, 4]))
    num_pages = draw(st.integers(1, 24))
    budget = draw(st.integers(1, 2 * num_pages * page_size))  # may exceed the pool
    max_num_seqs = draw(st.integers(1, 6))
    policy = draw(st.sampled_from(["fcfs", "lpm"]))
    reserve = draw(st.sampled_from([0, 1, 4, 16]))
    groups = draw(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(1, 3)),
                           min_size=1, max_size=6))
    arrivals = draw(st.lists(st.integers(0, 6), min_size=len(groups), max_size=len(groups)))
    return page_size, num_pages, budget, max_num_seqs, policy, reserve, groups, arrivals


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_without_leaks(workload):
    page_size, num_pages, budget, max_num_seqs, policy, reserve, groups, arrivals = workload
    eng = FakeEngine(num_pages=num_pages, page_size=page_size, budget=budget, max_num_seqs=max_num_seqs,
                     policy=policy, decode_reserve_tokens=reserve)
    pending = sorted(zip(arrivals, range(len(groups))))
    all_reqs = []
    made = {}
    for _, gi in pending:
        p, o, n = groups[gi]
        made[gi] = make_group(p, o, n)
        all_reqs += made[gi]
    bound = step_bound(all_reqs) + max(arrivals)
    t = 0
    while pending or eng.sched.has_work:
        while pending and pending[0][0] <= t:
            eng.add(*made[pending.pop(0)[1]])
        if eng.sched.has_work:
            eng.step()
        t += 1
        assert t <= bound, "requests did not finish within the step bound"
    assert eng.pool.allocator.num_free == num_pages, "pages leaked"
    for r in all_reqs:
        assert r.is_finished and r.pages == []
        fits = cdiv(r.prompt_len + r.params.max_new_tokens - 1, page_size) <= num_pages
        if fits:
            assert r.finish_reason == "length", f"request {r.rid} fits the pool but ended with {r.finish_reason}"
            assert r.output_ids == expected_output(r, r.params.max_new_tokens)
        else:
            assert r.finish_reason in ("error", "length")
            assert r.output_ids == expected_output(r, r.num_output_tokens)
            assert (r.finish_reason == "error") == (r.num_output_tokens == 0)
