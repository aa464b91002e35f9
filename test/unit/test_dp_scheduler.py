"""The data-parallel front scheduler on its own (no workers): placement by prefix, then by load; siblings follow
their leader; a step is every rank's schedule in rank order, and updates reach each rank by its items."""
from __future__ import annotations

from hypothesis import given, strategies as st

from deepinfer_rt.cache.kv_pool import PageAllocator
from deepinfer_rt.config import SchedulerConfig
from deepinfer_rt.distributed.dp_scheduler import DPScheduler, RankPool, _common_prefix
from deepinfer_rt.request import Req
from deepinfer_rt.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=4)


def _dp(num_ranks: int = 3, pages: int = 64) -> DPScheduler:
    return DPScheduler(SchedulerConfig(max_num_seqs=8, chunked_prefill_tokens=256),
                       [RankPool(PageAllocator(pages), 4) for _ in range(num_ranks)], enable_prefix_cache=True)


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40), st.integers(1, 8))
def test_common_prefix_matches_the_plain_loop(a, b, min_len):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert _common_prefix(a, b, min_len) == (n if n >= min_len else 0)


def test_new_requests_spread_by_load_and_shared_prompts_stay_together():
    dp = _dp()
    shared = list(range(100, 140))
    reqs = [Req(0, shared + [1], PARAMS, 0), Req(1, list(range(200, 210)), PARAMS, 0),
            Req(2, list(range(300, 305)), PARAMS, 0), Req(3, shared + [2, 3], PARAMS, 0)]
    for r in reqs:
        dp.add(r)
    ranks = [dp.rank_of[r.rid] for r in reqs]
    assert ranks[:3] == [0, 1, 2]  # no prefix anywhere: the least loaded rank each time
    assert ranks[3] == ranks[0]  # shares 40 tokens with a request waiting on rank 0
    batch = dp.schedule()  # rank 0 admits request 3 a step later, to reuse request 0's prefix
    assert [it.req.rid for it in batch.items] == [0, 1, 2] and len(batch.parts) == 3
    assert [[it.req.rid for it in part.items] for part in batch.parts] == [[0], [1], [2]]
    dp.update(batch)
    batch = dp.schedule()
    assert [[it.req.rid for it in part.items] for part in batch.parts] == [[3], [], []]
    dp.update(batch)
    assert all(r.num_computed_tokens == r.num_tokens for r in reqs)


def test_a_cached_prefix_draws_its_request_to_that_rank():
    dp = _dp()
    first = Req(0, list(range(40)) + [9], PARAMS, 0)
    dp.add(first)
    dp.update(dp.schedule())
    dp.finish(first)  # its KV goes to rank 0's radix tree
    for rid, n in [(1, 20), (2, 20), (3, 20), (4, 60)]:
        dp.add(Req(rid, list(range(1000 * rid, 1000 * rid + n)), PARAMS, 0))
    assert [dp.rank_of[rid] for rid in (1, 2, 3, 4)] == [0, 1, 2, 0]  # rank 0 now has the most to serve
    follower = Req(5, list(range(40)) + [7, 7], PARAMS, 0)
    dp.add(follower)
    assert dp.rank_of[follower.rid] == 0
    batch = dp.schedule()
    assert follower.num_cached_tokens == 40
    assert dp.cache.stats()["num_hit_tokens"] == 40 and batch.parts[0].items
