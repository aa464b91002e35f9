"""Fakes for the scheduler tests: requests with deterministic tokens and an engine loop with no model.

The fake forward writes, for every computed position, K = [token id, position, 1, 0] into the pool, and checks
before each step that the KV a request already computed is still intact at its slots. That catches a page
handed to two requests, a page freed while still read, or a partly filled page shared instead of copied.
Tokens come from a deterministic function of (prompt, seed, position), so the final sequences must not
depend on batching, chunking or retraction.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
        for src, dst in batch.kv_copies:  # what the executor does before the forward
            self.pool.copy_slots(src, dst)
        if batch.is_empty:
            assert not sched.has_work, "empty batch while requests remain: the engine would spin or raise"
        items = [(it.req, it.start, it.num_new_tokens, it.is_sampling) for it in batch.items]
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
        samplers = [it.req for it in batch.items if it.is_sampling]  # before update: depends on computed count
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
