"""Scheduler sharing and random workloads with no model: n > 1 followers reuse their leader's prompt pages,
and hypothesis workloads finish without leaked pages (fakes in scheduler_fakes.py)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_rt.request import ReqStatus
from scheduler_fakes import FakeEngine, cdiv, expected_output, fake_token, make_group, step_bound

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
    for src, dst in batch.kv_copies:  # what the executor does before the forward
        eng.pool.copy_slots(src, dst)
    by_req = {id(it.req): it for it in batch.items}
    num_shared = prompt_len - 1
    num_full, rem = divmod(num_shared, page_size)
    for f in followers:
        it = by_req[id(f)]
        assert f.num_computed_tokens == num_shared == it.start
        assert it.num_new_tokens == 1 and it.is_sampling
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
    samplers = [it.req for it in batch.items if it.is_sampling]
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
